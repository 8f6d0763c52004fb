"""Your own system prompt through ``RLM()``: ``custom_system_prompt`` (rlms' keyword) for every depth,
``PromptConfig.system_prompts`` per depth (SkyRL's parent/child prompts), their placeholders, and
``PromptConfig.style`` (``RLM(agent_config=AgentConfig(prompt=PromptConfig(...)))``) -- checked in what the model saw (turn 0's
prompt text, the chat-templated tokens the scripted policy was given). Training configs take the same fields."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf
from rlm_testlib import block

from workers.agents.scripted import ReplayScript, scripted_generate
from workers.rlm.agent import AgentConfig
from workers.rlm.env_loop import RLMEnvConfig
from workers.rlm.inference import RLM
from workers.rlm.prompts import PromptConfig

pytestmark = pytest.mark.timeout(120)

DEFAULT_ROLE = "You answer a request about a context"  # the built-in "full" prompt's first words


SCRIPT = {
    "Q-root": [block("print(rlm_query('child-Q', context='xyz'))"), "FINAL(ok)"],
    "child-Q": ["FINAL(child ok)"],
}


def run_rlm(tok, sandbox, **kw):
    seen: list[str] = []

    def respond(prompt: str) -> str:
        seen.append(prompt)
        return ReplayScript(SCRIPT)(prompt)

    with RLM(
        engine=scripted_generate(tok, respond), tokenizer=tok, sandbox=sandbox, max_depth=1, **kw
    ) as rlm:
        res = rlm.completion("Q-root", context="abcdefghij")
    assert res.status == "finished"
    root, child = res.trajectories
    return root.turns[0].prompt_text, child.turns[0].prompt_text, seen


def test_custom_system_prompt_with_placeholders(tok, sandbox):
    custom = (
        "You are a careful analyst.\n{context_info}\nFunctions:\n{tools}\n"
        "Depth {depth}; {max_iterations} turns. Code may use dicts like {'a': 1} and {unknown}."
    )
    root, child, seen = run_rlm(tok, sandbox, custom_system_prompt=custom, max_iterations=4)
    system = root.split("<|im_start|>user")[0]
    assert "You are a careful analyst." in system and DEFAULT_ROLE not in system
    assert "`context` is a str of 10 characters." in system  # {context_info}
    assert "- `llm_query(prompt) -> str`" in system and "rlm_query(prompt, context=None) -> str" in system
    assert "Depth 0; 4 turns." in system and "{'a': 1} and {unknown}" in system  # other braces stay
    assert "You are a careful analyst." in child and "Depth 1;" in child and "3 characters" in child
    assert seen[0].startswith(root)  # what the model was given
    # at the depth cap the {tools} listing says rlm_query is a plain call
    assert "no further helper agents can be started" in child


def test_per_depth_system_prompts(tok, sandbox):
    prompts = {0: "ROOT PROMPT. {context_info}", 1: "CHILD PROMPT, depth {depth}."}
    root, child, _ = run_rlm(
        tok, sandbox, agent_config=AgentConfig(prompt=PromptConfig(system_prompts=prompts))
    )
    assert "ROOT PROMPT. `context` is a str of 10 characters." in root and "CHILD PROMPT" not in root
    assert "CHILD PROMPT, depth 1." in child and "ROOT PROMPT" not in child and DEFAULT_ROLE not in child
    # a per-depth entry wins over custom_system_prompt; depths without one use it
    per_depth = AgentConfig(prompt=PromptConfig(system_prompts={1: "CHILD ONLY."}))
    root, child, _ = run_rlm(tok, sandbox, custom_system_prompt="EVERYONE.", agent_config=per_depth)
    assert "EVERYONE." in root and "CHILD ONLY." in child and "EVERYONE." not in child


def test_prompt_style_and_extra_instructions(tok, sandbox):
    root, _, _ = run_rlm(tok, sandbox, agent_config=AgentConfig(prompt=PromptConfig(style="compact")))
    assert "Answer the request using a persistent Python REPL." in root and DEFAULT_ROLE not in root
    root, _, _ = run_rlm(tok, sandbox)
    assert DEFAULT_ROLE in root
    with pytest.raises(ValueError, match="system_prompts keys must be depths"):
        PromptConfig(system_prompts={-1: "x"})


def test_training_config_takes_the_prompts_and_accounting_fields():
    """What a recipe's YAML sets under ``env.agent`` (OmegaConf over the structured config)."""
    yaml = """
    agent:
      max_total_tokens: 50000
      prices: {policy: [0.5, 1.5]}
      max_cost_usd: 0.25
      max_errors: 3
      final_answer_on_exhaustion: true
      prompt:
        custom_system_prompt: "Solve it. {context_info}"
        system_prompts: {1: "You are a helper."}
    """
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RLMEnvConfig), OmegaConf.create(yaml)))
    agent = cfg.agent
    assert (agent.max_total_tokens, agent.max_cost_usd, agent.max_errors) == (50000, 0.25, 3)
    assert agent.prices == {"policy": [0.5, 1.5]} and agent.final_answer_on_exhaustion is True
    assert agent.prompt.custom_prompt(0) == "Solve it. {context_info}"
    assert agent.prompt.custom_prompt(2) == "You are a helper."
