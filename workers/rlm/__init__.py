"""Recursive Language Model (RLM) environments: the policy writes Python in a persistent sandboxed REPL that holds
a (possibly huge) context, calls sub-LMs and child agents from its code, and answers with ``FINAL(...)``.

Modules: ``protocol`` (turn parsing, observations), ``prompts`` (system prompt, context metadata), ``agent``
(``RLMAgent``: the loop with recursion and budgets), ``env_loop`` (``RLMEnvConfig``, ``RLMLoop``: the env plugin
the agent layer's env workers run, ``env.loop: rlm``), ``inference`` (``RLM(...).completion``) and ``viewer``
(static HTML of JSONL trajectories). What every environment shares (records, batches, LLM clients) is in
``workers.agents``.
"""
