"""The tool-use math environment in the model family's own tool-call format (``ToolAgentConfig.tool_format``):
the Python tool declared as an OpenAI schema and rendered by the chat template, calls parsed by the family's
parser, results as ``tool`` messages, malformed and invalid calls answered with an error the model reads (never a
crash), in a real sandbox; and the token-exact records under a template that rewrites history."""

from __future__ import annotations

import asyncio
import json

import pytest

from workers.agents.batch import trajectories_to_dataproto
from workers.agents.llm import EngineLLM
from workers.agents.scripted import ReplayScript, scripted_generate
from workers.math_env.agent import MathToolAgent, ToolAgentConfig
from workers.models import load_tokenizer
from workers.models.tiny import ensure_tiny_model
from workers.sandbox import ReplSandbox, SandboxConfig

pytestmark = pytest.mark.timeout(120)


def hermes(name, arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def run(template: str, fmt: str, turns: list[str], max_turns: int = 8):
    tok = load_tokenizer(ensure_tiny_model("nano", chat_template=template))
    seen: list[str] = []
    script = ReplayScript({"PROBLEM": turns})

    def respond(prompt_text: str) -> str:
        seen.append(prompt_text)
        return script(prompt_text)

    policy = EngineLLM(scripted_generate(tok, respond, log_prob=-0.5, tokenization="chars"), tok)
    sandbox = ReplSandbox(SandboxConfig(timeout_s=10, echo_last_expr=True))
    cfg = ToolAgentConfig(max_turns=max_turns, max_new_tokens=256, tool_format=fmt)
    try:
        traj = asyncio.run(MathToolAgent(policy, sandbox, cfg).run("PROBLEM", uid="u", traj_id="u.0", seed=1))
    finally:
        sandbox.close()
    return tok, traj, seen


def test_hermes_calls_run_in_the_sandbox_and_come_back_as_tool_messages():
    turns = [hermes("python", {"code": "x = 1234 + 5678\nprint(x)"}), "It is \\boxed{6912}"]
    _, traj, seen = run("qwen3", "hermes", turns)
    assert traj.status == "finished" and traj.final_answer == "\\boxed{6912}"
    # the template rendered the tool schema into the first prompt, and the result as Qwen's tool response
    assert '<tools>\n{"type": "function", "function": {"name": "python"' in seen[0]
    assert seen[1].endswith("<|im_start|>user\n<tool_response>\nOutput:\n6912\n</tool_response><|im_end|>\n"
                            "<|im_start|>assistant\n")  # fmt: skip
    assert [s["kind"] for s in traj.metadata["steps"]] == ["tool", "answer"]
    assert traj.turns[0].code_results[0].stdout == "6912\n"
    assert traj.metadata["tool_format"] == "hermes"
    assert traj.metadata["tool"]["tool_calls"] == 1 and traj.metadata["tool"]["malformed"] == 0


def test_malformed_and_invalid_calls_are_error_observations_and_counted():
    turns = [
        '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"\n</tool_call>',  # bad JSON
        hermes("calculator", {"expr": "1+1"}),  # unknown tool
        hermes("python", {"code": 5}),  # wrong argument type
        hermes("python", {"code": "print(6 * 7)"}),
        "<tool_call>\nprint(2)",  # never closed
        "I am not sure.",  # neither a call nor an answer
        "\\boxed{42}",
    ]
    _, traj, seen = run("qwen3", "hermes", turns, max_turns=10)
    assert traj.status == "finished" and traj.final_answer == "\\boxed{42}"
    assert [s["kind"] for s in traj.metadata["steps"]] == [
        "malformed", "malformed", "malformed", "tool", "malformed", "malformed", "answer"
    ]  # fmt: skip
    obs = [s["observation"] for s in traj.metadata["steps"]]
    assert obs[0].startswith("Error: the tool call is not valid JSON")
    assert obs[1] == "Error: unknown tool 'calculator'; the tools are: python"
    assert obs[2] == "Error: argument 'code' must be a string, got integer"
    assert obs[3] == "Output:\n42"
    assert obs[4].startswith("Error:") and "never closed" in obs[4]
    assert obs[5].startswith("Format error: No tool call and no answer found")
    # the model read each one: tool errors as tool responses, the correction as a user message
    assert "<tool_response>\nError: unknown tool 'calculator'" in seen[2]
    assert seen[6].endswith("<|im_start|>user\n" + obs[5] + "<|im_end|>\n<|im_start|>assistant\n")
    assert traj.metadata["tool"]["malformed"] == 5 and traj.metadata["tool"]["tool_calls"] == 1


def test_llama3_json_calls_with_a_llama_style_template():
    call = json.dumps({"name": "python", "parameters": {"code": "print(7 * 6)"}})
    _, traj, seen = run("llama3", "llama3_json", [call, "\\boxed{42}"])
    assert traj.status == "finished" and traj.final_answer == "\\boxed{42}"
    assert "Environment: ipython" in seen[0] and '"name": "python"' in seen[0]
    assert seen[1].endswith("<|im_start|>ipython\nOutput:\n42<|im_end|>\n<|im_start|>assistant\n")


def test_reasoning_dropped_by_the_template_trains_step_wise_on_exact_tokens():
    think = "Python computes it exactly.</think>\n"  # the template's generation prompt opened <think>
    turns = [think + hermes("python", {"code": "print(40 + 2)"}), think + "\\boxed{42}"]
    tok, traj, seen = run("deepseek_r1", "hermes", turns)
    assert traj.status == "finished" and traj.rewritten and traj.final_answer == "\\boxed{42}"
    assert seen[0].endswith("<|im_start|>assistant\n<think>\n")
    assert "Python computes" not in seen[1]  # the second prompt is the template's rendering: reasoning gone
    batch = trajectories_to_dataproto([traj], max_prompt_length=2048, max_response_length=256, pad_token_id=0)
    assert len(batch) == 2
    P = batch.batch["prompts"].shape[1]
    for i, turn in enumerate(traj.turns):
        keep = batch.batch["attention_mask"][i, :P].bool()
        assert batch.batch["prompts"][i][keep].tolist() == tok.encode(seen[i], add_special_tokens=False)
        n = len(turn.response_token_ids)
        assert batch.batch["responses"][i, :n].tolist() == turn.response_token_ids
        assert int(batch.batch["response_mask"][i].sum()) == n


def test_an_unknown_tool_format_is_refused_naming_the_known_parsers():
    with pytest.raises(ValueError, match="tool_format.*hermes"):
        ToolAgentConfig(tool_format="mistral_xml")
