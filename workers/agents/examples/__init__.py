"""Example agent environments, each complete in one file (``docs/agent_env.md`` walks through ``word_count``)."""
