"""The native engine tags every sampled token with the weight version that sampled it, takes a weight update
between two decode steps (from another thread too: asynchronous RL), and can abort the requests that started
on the old weights at that update."""

import threading
import time

import pytest
import torch

from dataproto import DataProto
from tests.workers.rollout.test_native_engine import make_prompts, tiny_model
from workers.rollout.native import EngineConfig, NativeEngine
from workers.rollout.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


@pytest.fixture(autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def engine_for(model, **kw) -> NativeEngine:
    # no EOS: every request runs to its token budget, so an update always lands mid-generation
    return NativeEngine(model, config=EngineConfig(max_num_seqs=8, eos_token_ids=[], **kw))


def new_weights(seed: int):
    return list(tiny_model(seed=seed).state_dict().items())


# Long enough that an update from another thread lands mid-generation even on a loaded machine (the tiny model
# holds 1,024 positions); the update must get in within this many tokens of being asked for.
LONG = 1000


class Generating(threading.Thread):
    """``fn()`` on a thread of its own, keeping its result or its error for the test to see."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None
        self.start()

    def run(self):
        try:
            self.result = self.fn()
        except BaseException as exc:  # noqa: BLE001 -- reported by wait_for_tokens / finish
            self.error = exc

    def wait_for_tokens(self, engine, n: int, timeout_s: float = 60.0) -> None:
        """Until the engine has generated ``n`` tokens: fails (never hangs) when the generation raised, ended
        first or did not get there in ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while engine.stats["generated_tokens"] < n:
            if not self.is_alive():
                raise AssertionError(f"the generation ended before {n} tokens") from self.error
            if time.monotonic() > deadline:
                raise AssertionError(f"no {n} tokens generated within {timeout_s:g} s")
            time.sleep(0.001)

    def finish(self, timeout_s: float = 120.0):
        self.join(timeout_s)
        assert not self.is_alive(), f"the generation did not end within {timeout_s:g} s"
        if self.error is not None:
            raise self.error
        return self.result


def test_tokens_after_an_update_between_steps_carry_the_new_version():
    old, prompt = tiny_model(seed=0), make_prompts([6])[0]
    reference = engine_for(tiny_model(seed=0)).generate_batch([prompt], GREEDY)[0][0]
    assert reference.versions == [0] * 12

    engine = engine_for(old)
    (req,) = engine.add_request(prompt, GREEDY)
    for _ in range(5):  # step 1 prefills (token 1) and decodes (token 2); steps 2-5 decode one each
        engine.step()
    assert len(req.tokens) == 6
    assert engine.update_weights(new_weights(seed=1), version=3) == 0  # nothing aborted
    while engine.has_unfinished():
        engine.step()
    out = req.output()
    assert out.versions == [0] * 6 + [3] * 6
    assert out.token_ids[:6] == reference.token_ids[:6]  # the old weights' tokens
    assert out.token_ids != reference.token_ids  # the new weights took over from token 7 on
    assert engine.weight_version == 3


def test_an_update_from_another_thread_lands_mid_generation():
    """The generating thread steps back to back; the update (another thread, as a concurrent rollout worker's
    weight receive) must still get in between two steps, not wait for the whole generation."""
    engine = engine_for(tiny_model(seed=0))
    params = SamplingParams(temperature=0.0, max_new_tokens=LONG)
    weights = new_weights(seed=1)  # built before: building a model while generating would eat the margin
    gen = Generating(lambda: engine.generate_batch(make_prompts([5, 9, 3]), params))
    gen.wait_for_tokens(engine, 6)  # generation under way
    engine.update_weights(weights, version=1)
    for (out,) in gen.finish():
        v = out.versions
        assert v == sorted(v) and v[0] == 0 and v[-1] == 1, v  # old tokens, then new ones, in order
        assert 2 <= v.index(1) < LONG


def test_abort_running_at_an_update_aborts_only_requests_started_on_old_weights():
    engine = engine_for(tiny_model(seed=0), max_prefill_tokens=64)
    engine.config.max_num_seqs = 1  # the second request waits in the queue, not started
    (first,) = engine.add_request(make_prompts([4])[0], GREEDY)
    (second,) = engine.add_request(make_prompts([7], seed=2)[0], GREEDY)
    engine.step()  # the first request: prefill + one decode step = 2 tokens
    assert engine.update_weights(new_weights(seed=1), version=1, abort_running=True) == 1
    while engine.has_unfinished():
        engine.step()
    assert first.output().finish_reason == "abort" and first.output().versions == [0, 0]
    assert second.output().finish_reason == "length" and second.output().versions == [1] * 12


def test_generate_sequences_returns_versions_and_aborted_rows():
    engine = engine_for(tiny_model(seed=0))
    prompts = make_prompts([5, 8])
    ids = torch.zeros(2, 8, dtype=torch.long)
    mask = torch.zeros(2, 8, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, 8 - len(p) :], mask[i, 8 - len(p) :] = torch.tensor(p), 1
    batch = DataProto.from_dict({"input_ids": ids, "attention_mask": mask})
    # long enough that the update lands mid-generation on a loaded machine (the abort ends it there)
    batch.meta_info = {"do_sample": False, "response_length": LONG}
    weights = new_weights(seed=1)  # built before the generation starts, not in its margin
    gen = Generating(lambda: engine.generate_sequences(batch))
    gen.wait_for_tokens(engine, 4)
    engine.update_weights(weights, version=2, abort_running=True)
    out = gen.finish()
    assert out.batch["rollout_aborted"].tolist() == [True, True]
    valid = out.batch["response_mask"] > 0
    assert valid.any(dim=1).all() and not valid.all(dim=1).any()  # stopped early, at the update
    assert (out.batch["rollout_versions"][valid] == 0).all()
