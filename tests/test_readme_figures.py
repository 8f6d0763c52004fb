"""README's quickstart result is the last full run's, not a figure typed in once: the block that shows what
`make demo` prints must equal benchmarks/results/quickstart.json (written from the run's own
``runs/quickstart/result.json``), and name that file's commit. A change to the numerics that changes the result
shows up in review as a changed JSON, README and commit, instead of in a user's terminal."""

import json
import re
from pathlib import Path

from tests.readme import README

RESULT = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "quickstart.json"


def test_readme_quickstart_figures_are_the_recorded_run():
    recorded = json.loads(RESULT.read_text())
    result = recorded["result"]
    text = README.read_text(encoding="utf-8")
    shown = re.search(
        r"validation accuracy (\d\.\d\d) -> (\d\.\d\d)\s+\(greedy, (\d+) held-out problems", text
    )
    wall = re.search(r"^wall time:\s+(\d+)s", text, re.MULTILINE)
    assert shown and wall, "README.md: the quickstart's printed result block is missing"
    assert (float(shown[1]), float(shown[2])) == (
        round(result["val_before"], 2),
        round(result["val_after"], 2),
    )
    assert int(shown[3]) == recorded["val_samples"]
    assert int(wall[1]) == round(result["wall_s"])
    assert re.fullmatch(r"[0-9a-f]{7,40}", recorded["commit"]) and recorded["commit"][:7] in text
    assert recorded["command"] in text


DEFAULTS = RESULT.with_name("recipe_defaults.json")


def test_readme_recipe_table_is_the_recorded_run_of_each_documented_command():
    """README's table of what `python -m recipes.grpo` / `ppo` / `grpo_async` do as they are equals
    benchmarks/results/recipe_defaults.json (`python -m benchmarks.bench_recipe_defaults`), names its commit,
    and every recorded command learned: held-out accuracy and reward up, no learning-signal warning."""
    recorded = json.loads(DEFAULTS.read_text())
    text = README.read_text(encoding="utf-8")
    assert re.fullmatch(r"[0-9a-f]{7,40}", recorded["commit"]) and recorded["commit"][:7] in text
    assert {r["recipe"] for r in recorded["results"]} == {"grpo", "ppo", "grpo_async"}
    for r in recorded["results"]:
        row = (
            f"| `{r['command']}` | {r['val_before']:.2f} -> {r['val_after']:.2f} | "
            f"{r['reward_first5']:.2f} -> {r['reward_last5']:.2f} | {r['steps']} | {r['wall_s']:.0f} s |"
        )
        assert row in text, f"README.md lacks the recorded row {row}"
        assert r["val_after"] > r["val_before"] and r["reward_last5"] > r["reward_first5"], r
        assert not r["no_signal_warning"], r


RLM = RESULT.with_name("rlm.json")


def test_readme_rlm_figures_are_the_recorded_run():
    """README's RLM result block equals benchmarks/results/rlm.json (`python -m recipes.rlm`'s own
    ``runs/rlm/result.json``, with its command and commit), and the recorded run learned."""
    recorded = json.loads(RLM.read_text())
    result = recorded["result"]
    text = README.read_text(encoding="utf-8")
    shown = re.search(
        r"RLM success rate (\d\.\d\d) -> (\d\.\d\d)\s+\(greedy, (\d+) held-out problems, step 0 -> step (\d+)\)",
        text,
    )
    wall = re.search(r"The default run \((\d+) s", text)
    assert shown and wall, "README.md: the RLM recipe's printed result block is missing"
    assert (float(shown[1]), float(shown[2])) == (
        round(result["val_before"], 2),
        round(result["val_after"], 2),
    )
    assert (int(shown[3]), int(shown[4])) == (recorded["val_samples"], result["steps"])
    assert int(wall[1]) == round(result["wall_s"])
    assert re.fullmatch(r"[0-9a-f]{7,40}", recorded["commit"]) and recorded["commit"][:7] in text
    assert recorded["command"] in text
    assert result["val_after"] > result["val_before"]


def test_readme_lora_figures_are_the_recorded_run():
    """README's LoRA sentence equals benchmarks/results/quickstart_lora.json and the full run's record, and the
    LoRA run raised held-out accuracy by at least 0.2 (the LoRA issue's bar)."""
    lora = json.loads(RESULT.with_name("quickstart_lora.json").read_text())
    full = json.loads(RESULT.read_text())["result"]
    r = lora["result"]
    text = " ".join(README.read_text(encoding="utf-8").split())
    shown = re.search(
        r"accuracy (\d\.\d\d) -> (\d\.\d\d) in (\d+) s, against (\d\.\d\d) -> (\d\.\d\d) in (\d+) s in full",
        text,
    )
    assert shown, "README.md: the LoRA quickstart sentence is missing"
    assert (float(shown[1]), float(shown[2]), int(shown[3])) == (
        round(r["val_before"], 2),
        round(r["val_after"], 2),
        round(r["wall_s"]),
    )
    assert (float(shown[4]), float(shown[5]), int(shown[6])) == (
        round(full["val_before"], 2),
        round(full["val_after"], 2),
        round(full["wall_s"]),
    )
    assert lora["command"] in text and lora["commit"][:7] in text
    assert r["val_after"] - r["val_before"] >= 0.2


WORD_COUNT = RESULT.with_name("word_count.json")
AGENT_ENV = README.parent / "docs" / "agent_env.md"


def test_the_word_count_example_learns_as_the_docs_say():
    """docs/agent_env.md's figures for the one-file example environment, run as documented, equal
    benchmarks/results/word_count.json, name its commit, and the recorded run learned: held-out success and
    training reward both rose (issue 56: as shipped before, it earned reward 0 on every step)."""
    recorded = json.loads(WORD_COUNT.read_text())
    result = recorded["result"]
    text = AGENT_ENV.read_text(encoding="utf-8")
    shown = re.search(
        r"word-count success rate (\d\.\d\d) -> (\d\.\d\d)\s+\(greedy, (\d+) held-out problems, "
        r"step 0 -> step (\d+)\)",
        text,
    )
    assert shown, "docs/agent_env.md: the word-count example's printed result is missing"
    assert (float(shown[1]), float(shown[2])) == (
        round(result["val_before"], 2),
        round(result["val_after"], 2),
    )
    assert (int(shown[3]), int(shown[4])) == (recorded["val_samples"], result["steps"])
    reward = f"{result['reward_first10']:.2f} over its first 10 steps, {result['reward_last10']:.2f} over its last 10"
    assert reward in text and f"in {round(result['wall_s'])} s" in text
    assert recorded["commit"] in text
    for command in recorded["command"].split(" && "):
        assert command in text
    assert result["val_after"] > result["val_before"] and result["reward_last10"] > result["reward_first10"]


OPENAI_AGENT = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "openai_agent.json"
OPENAI_AGENTS_DOC = Path(__file__).resolve().parents[1] / "docs" / "openai_agents.md"


def test_the_openai_agent_record_is_the_one_the_docs_show():
    """docs/openai_agents.md's table of full runs of rlm_openai_agent.yaml (issue 54) equals
    benchmarks/results/openai_agent.json, names its commit, and its arms start from one warm start."""
    recorded = json.loads(OPENAI_AGENT.read_text())
    text = OPENAI_AGENTS_DOC.read_text(encoding="utf-8")
    assert recorded["commit"] in text and recorded["val_samples"] == 32
    arms = recorded["arms"]
    assert len({arm["val_before"] for arm in arms.values()}) == 1, "the arms must share their warm start"
    for arm in arms.values():
        row = (
            f"{arm['val_before']:.2f} -> {arm['val_after']:.2f} | "
            f"{arm['reward_first10']:.2f} -> {arm['reward_last10']:.2f} | "
            f"{arm['entropy_step1']:.2f} -> {arm['entropy_max']:.2f} | {round(arm['wall_s'])} s |"
        )
        assert row in text, f"docs/openai_agents.md does not show {row!r}"
        assert arm["steps"] == 40 and len(arm["val_every_10_steps"]) == 5


TOOL_CALLS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "tool_calls.json"


def test_the_tool_calls_record_is_the_one_the_docs_show():
    """docs/agent_env.md's figures for a full run of rlm_tool_calls.yaml (issue 56: its time and result were not
    recorded) equal benchmarks/results/tool_calls.json and name its commit; the record shows the format learned."""
    recorded = json.loads(TOOL_CALLS.read_text())
    result = recorded["result"]
    # the page's line breaks are not part of its figures
    text = " ".join(AGENT_ENV.read_text(encoding="utf-8").split())
    assert recorded["command"] == "python -m recipes.rlm --config recipes/rlm_tool_calls.yaml"
    assert recorded["command"] in text and recorded["commit"] in text
    assert f"({round(result['wall_s'])} s at {recorded['commit']}" in text
    assert (
        f"greedy success is {result['val_before']:.2f} on {recorded['val_samples']} held-out problems" in text
    )
    assert result["val_after"] == result["val_before"], "the page says before and after are equal"
    reward = (
        f"training reward {result['reward_first5']:.2f} over the first 5 steps, {result['reward_last5']:.2f}"
    )
    assert reward in text and result["steps"] == 10
    assert result["val_finished_frac"] == 1.0 and result["val_calls_mean"] == 1.0
    assert result["val_malformed_mean"] == 0.0 and result["val_rewritten_frac"] == 1.0


MIXED = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "mixed.json"


def test_the_mixed_record_is_the_one_the_docs_show():
    """docs/agent_env.md's figures for rlm_mixed.yaml run as documented (issue 56: every documented command's time
    and result stated) equal benchmarks/results/mixed.json and name its commit."""
    recorded = json.loads(MIXED.read_text())
    result = recorded["result"]
    text = " ".join(AGENT_ENV.read_text(encoding="utf-8").split())
    for command in recorded["command"].split(" && "):
        assert command in text
    assert f"take {round(result['wall_s'])} s" in text and f"(at {recorded['commit']}" in text
    overall = f"{recorded['val_samples']} held-out problems goes {result['val_before']:.2f} -> {result['val_after']:.2f}"
    assert overall in text and f"in {result['steps']} steps" in text
    names = {"rlm": "the RLM REPL", "word_count": "word count", "tool_math": "tool math"}
    for env, (before, after) in result["per_env"].items():
        assert f"{names[env]} {before:.2f} -> {after:.2f}" in text
    assert (
        f"{result['reward_first4']:.2f} over the first 4 steps, {result['reward_last4']:.2f} over the last 4"
        in text
    )


MOE = RESULT.with_name("moe.json")
MOE_DOC = README.parent / "docs" / "moe.md"


def test_the_moe_figures_are_the_recorded_run():
    """docs/moe.md's quickstart-on-MoE line and replay table equal benchmarks/results/moe.json (issue 53), the
    recorded run learned, and replay brought the rollout-vs-trainer k3 KL down."""
    recorded = json.loads(MOE.read_text())
    text = MOE_DOC.read_text(encoding="utf-8")
    learning = recorded["learning"]
    result = learning["result"]
    line = (
        f"validation accuracy {result['val_before']:.2f} -> {round(result['val_after'], 2):.2f}  "
        f"(greedy, {learning['val_samples']} held-out problems, step 0 -> step {result['steps']})"
    )
    assert line in text and f"in {round(result['wall_s'])} s" in text
    assert learning["command"] in text
    assert result["val_after"] - result["val_before"] >= 0.2
    rows = {(r["model"].split("/")[-2] if "/" in r["model"] else r["model"], r["trainer routes"]): r for r in
            recorded["mismatch"]["trained"]["rows"]}  # fmt: skip
    own, replay = rows[("quickstart_moe", "own routers")], rows[("quickstart_moe", "replay rollout (R3)")]
    dense = rows[("quickstart", "own routers")]
    for row, label in ((own, "its own"), (replay, "replay rollout (R3)")):
        shown = f"| MoE | {label} | {row['route_mismatch']:.2%} | {row['logprob_diff_mean']:.4f} |"
        assert shown in text, shown
    assert f"| {dense['logprob_diff_mean']:.4f} | {dense['logprob_diff_max']:.2f} |" in text
    assert f"cuts it {own['k3_kl'] / replay['k3_kl']:.1f}x" in text
    assert replay["k3_kl"] < own["k3_kl"] / 2
    # README's sentence says the same
    readme = README.read_text(encoding="utf-8")
    shown = f"held-out accuracy {result['val_before']:.2f} -> {round(result['val_after'], 2):.2f} in {round(result['wall_s'])} s"
    assert shown in " ".join(readme.split()), shown
    assert f"k3 KL {own['k3_kl'] / replay['k3_kl']:.1f}x" in " ".join(readme.split())
