"""Reference replay (``workers.agents.replay``) through the RLM loop and a real sandbox: rows that share a
question (OOLONG asks the same of many contexts) each replay their own reference turns."""

from recipes.tasks import generate_splits
from workers.agents.replay import reference_trajectories
from workers.models import load_tokenizer
from workers.models.tiny import ensure_tiny_model
from workers.rlm.env_loop import RLMEnvConfig


def test_rows_with_one_question_replay_their_own_turns():
    rows = generate_splits(
        "oolong", 12, 0, seed=0, lengths="2000", label_mode="explicit", query_types="most_common",
        program="compact", sloppy_frac=0.5,
    )["train"]  # fmt: skip
    assert len({r["extra_info"]["question"] for r in rows}) == 1
    assert len({r["extra_info"]["reference_turns"][0] for r in rows}) == 2  # every line / the first 10 lines
    trajs = reference_trajectories(rows, load_tokenizer(ensure_tiny_model("nano")), RLMEnvConfig())
    kept = {int(t.id.removeprefix("ref")): t for t in trajs}
    for i, t in kept.items():
        assert t.turns[0].response_text == rows[i]["extra_info"]["reference_turns"][0], i
    heads = [rows[i]["extra_info"]["reference_head"] for i in kept]
    # every careful program answers right; the sloppy ones that are kept answered right too
    assert heads.count(0) == sum(r["extra_info"]["reference_head"] == 0 for r in rows) and 10 in heads
