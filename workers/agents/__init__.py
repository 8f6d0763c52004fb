"""What every multi-turn agent environment shares; an environment (RLM REPL, math tool, yours) is a plugin.

* ``trajectory``: the run record (``Trajectory``, ``TrajectoryTurn``, ``CodeResult``), JSONL in and out;
* ``batch``: trajectories -> the training ``DataProto`` (token-exact loss masks, children as rows);
* ``chat_format`` / ``llm``: the chat template in segments, the engine-backed token-exact LLM and the
  message-level chat LLM; ``clients``: ``make_llm(backend, backend_kwargs)`` -- OpenAI-compatible and Anthropic
  servers through their official libraries, our native and SGLang engines;
* ``turns``: the one turn loop (``run_turns``) an environment's ``Episode`` plugs into;
* ``limits``: the shared run ``Budget``, ``BudgetSpent`` and bounded concurrency (``gather_bounded``);
* ``scripted``: a scripted policy (tests, demos, the reference replay);
* ``loop``: the plugin API (``AgentLoop``, ``AgentEnvConfig``, ``env.loop`` names a plugin);
* ``env_worker``: the env role ``EnvWorker`` (sharing a rollout role's engine), whose ``generate_sequences``
  runs the env's loop;
* ``replay``: reference turns replayed through a loop into an SFT batch (``reference_batch``);
* ``tool_calls`` / ``tool_use``: tools declared as OpenAI function schemas, called in the model family's own
  format (``hermes``, ``llama3_json``, yours), answered as ``tool`` messages;
* ``mixed``: several environments in one run, a row's ``env_name`` picking its own (``env.loop: mixed``);
* ``examples/word_count``: a complete tool environment in one file (``docs/agent_env.md``).

Import from the modules: the worker modules pull in engines, the sandbox and Ray.
"""
