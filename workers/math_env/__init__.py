"""A multi-turn tool-use math environment: the policy runs Python in the project's sandbox and answers in
``\\boxed{}``. Modules: ``protocol`` (turn parsing, observations, the outcome verifier), ``agent``
(``MathToolAgent``: the loop) and ``env_loop`` (``MathToolEnvConfig``, ``MathToolLoop``: the env plugin the agent
layer's env workers run, ``env.loop: math_tool``)."""
