"""SGLang adapter: recording a mixture of experts' routes (R3) without a running engine.

SGLang's CPU engine cannot run an MoE model here (docs/moe.md: it loads the tiny Qwen3-MoE and makes no
progress), so these tests build the ``meta_info["routed_experts"]`` the server returns with SGLang's own encoder
(``DetokenizerManager._b64_encode_per_request`` over the int32 ``[prompt + output - 1, num_hidden_layers, top-k]``
tensor its capturer gathers, dense layers' rows 0) and check it against SGLang's own reader
(``extract_routed_experts_from_meta_info``); a stand-in engine answers ``Engine.generate`` /
``async_generate`` with it and records the keywords each request is sent with. What is not checked: a real
SGLang engine recording them (a GPU SGLang would).
"""

import asyncio
import dataclasses
import inspect
import json
import uuid

import numpy as np
import pytest
import torch

from dataproto import DataProto
from workers.rollout.batch import RolloutRow, build_rollout_batch
from workers.rollout.sampling import SamplingParams
from workers.rollout.sglang import (
    RouteLayout,
    SGLangRollout,
    SGLangRolloutConfig,
    decode_routed_experts,
    output_to_generation,
)

PAD = 0
EOS = 2
LAYERS, TOP_K, EXPERTS = 3, 2, 8


@pytest.fixture(scope="module")
def sglang_codec(sglang_module):
    """SGLang's own encoder and reader of ``meta_info["routed_experts"]`` (the CPU import shims where no CUDA)."""
    from workers.rollout.sglang import import_sglang

    import_sglang("cuda" if torch.cuda.is_available() else "cpu")
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager
    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    def encode(tensor: torch.Tensor) -> str:
        return DetokenizerManager._b64_encode_per_request([tensor])[0]

    return encode, extract_routed_experts_from_meta_info


def write_config(path, arch="Qwen3MoeForCausalLM", **extra):
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": [arch], "num_hidden_layers": LAYERS, "hidden_size": 16}
    if arch != "Qwen3ForCausalLM":
        key = "num_local_experts" if arch == "MixtralForCausalLM" else "num_experts"
        config |= {key: EXPERTS, "num_experts_per_tok": TOP_K, "decoder_sparse_step": 1}
    config |= extra
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def sglang_routes(positions: int, seed: int, dense_layers=()) -> torch.Tensor:
    """What SGLang's capturer gathers for a request: int32 [positions, num_hidden_layers, k], distinct experts per
    (position, layer); a dense layer's rows stay 0 (its zero-filled buffer)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(positions * LAYERS)])
    ids = ids.reshape(positions, LAYERS, TOP_K).to(torch.int32)
    ids[:, list(dense_layers)] = 0
    return ids


class RoutesEngine:
    """Stands in for ``sglang.Engine``: answers each request with ``output_len`` tokens and, when asked for them
    (``return_routed_experts=True``), the routes SGLang would return, encoded by SGLang; records the keywords."""

    def __init__(self, encode, output_lens, dense_layers=()):
        self.encode = encode
        self.output_lens = output_lens
        self.dense_layers = dense_layers
        self.requests: list[dict] = []
        self.sent: list[torch.Tensor] = []  # the int32 routes of every answer, in order

    def _answer(self, ids, n_out, seed, return_routed_experts):
        output_ids = [100 + seed * 10 + j for j in range(n_out - 1)] + [EOS]
        meta = {
            "id": uuid.uuid4().hex,
            "finish_reason": {"type": "stop", "matched": EOS},
            "prompt_tokens": len(ids),
            "completion_tokens": n_out,
            "cached_tokens": 0,
            "output_token_logprobs": [(-0.5, t, None) for t in output_ids],
        }
        if return_routed_experts:
            routes = sglang_routes(len(ids) + n_out - 1, seed, self.dense_layers)
            self.sent.append(routes)
            meta["routed_experts"] = self.encode(routes)
        return {"text": "", "output_ids": output_ids, "meta_info": meta}

    def generate(self, input_ids, sampling_params, return_logprob=False, return_routed_experts=False):
        self.requests.append(
            {"return_logprob": return_logprob, "return_routed_experts": return_routed_experts}
        )
        return [
            self._answer(ids, self.output_lens[i], i, return_routed_experts)
            for i, ids in enumerate(input_ids)
        ]

    async def async_generate(
        self, input_ids, sampling_params, return_logprob=False, return_routed_experts=False
    ):
        self.requests.append(
            {"return_logprob": return_logprob, "return_routed_experts": return_routed_experts}
        )
        return self._answer(input_ids, self.output_lens[0], 0, return_routed_experts)


def rollout_over(engine, model_path, **config):
    cfg = SGLangRolloutConfig(model_path=model_path, pad_token_id=PAD, eos_token_ids=[EOS], **config)
    return SGLangRollout(cfg, engine=engine)


def prompts_batch():
    input_ids = torch.tensor([[PAD, PAD, 7, 8, 9], [11, 12, 13, 14, 15]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    return DataProto.from_dict(
        {"input_ids": input_ids, "attention_mask": mask}, meta_info={"response_length": 6}
    )


# ================================================================================= decoding


def test_decoding_sglangs_payload_gives_the_native_alignment(sglang_codec):
    """SGLang's payload (its encoder) decodes to [prompt + output - 1, MoE layers, k] int16, what SGLang's own
    reader gives; the rollout batch places row j at input position j of the row, -1 on padding and the last token."""
    encode, extract = sglang_codec
    layout = RouteLayout(num_layers=LAYERS, top_k=TOP_K, moe_layers=(0, 1, 2))
    prompt, response = [7, 8, 9], [21, 22, 23, EOS]
    sent = sglang_routes(len(prompt) + len(response) - 1, seed=3)
    meta = {"routed_experts": encode(sent)}
    routes = decode_routed_experts(meta["routed_experts"], len(prompt) + len(response) - 1, layout)
    assert routes.dtype == torch.int16 and routes.shape == (6, LAYERS, TOP_K)
    assert torch.equal(routes, sent.to(torch.int16))
    assert np.array_equal(routes.numpy().reshape(-1), extract({"meta_info": meta}))  # SGLang's reader agrees

    out = output_to_generation(
        {"output_ids": response, "meta_info": {"finish_reason": {"type": "stop"}, **meta}},
        want_log_probs=False,
        routes=layout,
        prompt_length=len(prompt),
    )
    assert torch.equal(out.routes, routes)
    P, R = 5, 6
    column = build_rollout_batch(
        [RolloutRow(prompt, response, routes=out.routes)],
        pad_token_id=PAD,
        prompt_length=P,
        response_length=R,
    )["routed_experts"][0]
    start = P - len(prompt)
    assert (column[:start] == -1).all()  # left padding
    assert torch.equal(column[start : start + 6], sent.to(torch.int16))  # every position fed, in input order
    assert (column[start + 6 :] == -1).all()  # the last token (never fed) and right padding

    with pytest.raises(ValueError, match="expected 7 positions"):
        decode_routed_experts(
            meta["routed_experts"], 7, layout
        )  # a position coverage other than prompt+output-1


def test_dense_layers_are_dropped_from_sglangs_every_layer_payload(sglang_codec):
    """SGLang's layer axis is every decoder layer (a dense one's rows 0); the routes keep the routing layers."""
    encode, _ = sglang_codec
    sent = sglang_routes(4, seed=1, dense_layers=(1,))
    layout = RouteLayout(num_layers=LAYERS, top_k=TOP_K, moe_layers=(0, 2))
    routes = decode_routed_experts(encode(sent), 4, layout)
    assert routes.shape == (4, 2, TOP_K)
    assert torch.equal(routes, sent[:, [0, 2]].to(torch.int16))


# ================================================================================= requests and engine start


def test_moe_model_starts_the_engine_and_asks_every_request_for_routes(sglang_codec, tmp_path):
    encode, _ = sglang_codec
    path = write_config(tmp_path / "moe")
    cfg = SGLangRolloutConfig(model_path=path)
    assert cfg.server_kwargs()["enable_return_routed_experts"] is True
    assert cfg.route_layout() == RouteLayout(num_layers=LAYERS, top_k=TOP_K, moe_layers=(0, 1, 2))

    engine = RoutesEngine(encode, output_lens=[4, 6])
    rollout = rollout_over(engine, path)
    out = rollout.generate_sequences(prompts_batch())
    assert engine.requests == [{"return_logprob": True, "return_routed_experts": True}]
    column = out.batch["routed_experts"]
    assert column.shape == (2, 5 + 6, LAYERS, TOP_K) and column.dtype == torch.int16
    for row, (plen, olen) in enumerate([(3, 4), (5, 6)]):
        start = 5 - plen
        fed = plen + olen - 1
        assert torch.equal(column[row, start : start + fed], engine.sent[row].to(torch.int16))
        assert (column[row, :start] == -1).all() and (column[row, start + fed :] == -1).all()

    one = RoutesEngine(encode, output_lens=[3])
    single = asyncio.run(rollout_over(one, path).generate([7, 8], SamplingParams(max_new_tokens=3)))
    assert one.requests[-1]["return_routed_experts"] is True
    assert torch.equal(single.routes, one.sent[0].to(torch.int16)) and single.routes.shape[0] == 2 + 3 - 1


def test_a_dense_model_asks_for_no_routes(sglang_codec, tmp_path):
    encode, _ = sglang_codec
    path = write_config(tmp_path / "dense", arch="Qwen3ForCausalLM")
    assert "enable_return_routed_experts" not in SGLangRolloutConfig(model_path=path).server_kwargs()
    engine = RoutesEngine(encode, output_lens=[2, 2])
    out = rollout_over(engine, path).generate_sequences(prompts_batch())
    assert engine.requests == [{"return_logprob": True, "return_routed_experts": False}]
    assert "routed_experts" not in out.batch
    with pytest.raises(ValueError, match="the model is dense"):
        SGLangRolloutConfig(model_path=path, record_routes=True).server_kwargs()


def test_an_moe_model_sglang_records_no_layers_of_asks_for_none(sglang_codec, tmp_path, caplog):
    """Mixtral's TopK in SGLang 0.5.20 has no layer_id: asking would corrupt or crash its capture."""
    encode, _ = sglang_codec
    path = write_config(tmp_path / "mixtral", arch="MixtralForCausalLM")
    assert "enable_return_routed_experts" not in SGLangRolloutConfig(model_path=path).server_kwargs()
    engine = RoutesEngine(encode, output_lens=[2, 2])
    with caplog.at_level("WARNING"):
        rollout = rollout_over(engine, path)
    assert "records no per-layer routes" in caplog.text
    rollout.generate_sequences(prompts_batch())
    assert engine.requests[-1]["return_routed_experts"] is False
    with pytest.raises(ValueError, match="MixtralForCausalLM records no per-layer routes"):
        SGLangRolloutConfig(model_path=path, record_routes=True).server_kwargs()
    moe = write_config(tmp_path / "moe")
    assert (
        "enable_return_routed_experts"
        not in SGLangRolloutConfig(model_path=moe, record_routes=False).server_kwargs()
    )


def test_a_finished_request_without_routes_is_an_error(sglang_codec, tmp_path):
    layout = RouteLayout(num_layers=LAYERS, top_k=TOP_K, moe_layers=(0, 1, 2))
    answer = {"output_ids": [5, EOS], "meta_info": {"finish_reason": {"type": "stop"}}}
    with pytest.raises(KeyError, match="enable_return_routed_experts"):
        output_to_generation(answer, want_log_probs=False, routes=layout, prompt_length=3)
    aborted = {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "x"}}}
    assert output_to_generation(aborted, want_log_probs=False, routes=layout, prompt_length=3).routes is None
    encode, _ = sglang_codec
    wrong = encode(sglang_routes(2, seed=0))  # 2 positions, not 3 + 2 - 1
    answer["meta_info"]["routed_experts"] = wrong
    with pytest.raises(ValueError, match="expected 4 positions"):
        output_to_generation(answer, want_log_probs=False, routes=layout, prompt_length=3)
    aborted["meta_info"]["routed_experts"] = encode(sglang_routes(1, seed=0))  # 1 position, not 3 + 0 - 1
    assert output_to_generation(aborted, want_log_probs=False, routes=layout, prompt_length=3).routes is None


def test_the_sglang_names_the_adapter_uses_exist(sglang_codec):
    """The server argument, the request field and the Engine keywords, as SGLang 0.5.20 spells them."""
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.server_args import ServerArgs

    assert "enable_return_routed_experts" in inspect.signature(ServerArgs).parameters  # a msgspec Struct
    assert "return_routed_experts" in {f.name for f in dataclasses.fields(GenerateReqInput)}
    for method in (Engine.generate, Engine.async_generate):
        assert "return_routed_experts" in inspect.signature(method).parameters


def test_the_config_check_lets_rollout_replay_through_with_sglang(sglang_codec):
    """``records_routes`` is True: the tiny MoE (a Qwen3-MoE) with ``routing_replay=rollout`` on SGLang passes the
    check that refuses an engine recording none (tests/recipes/test_moe_recipe.py)."""
    from recipes.config import load_config

    assert SGLangRollout.records_routes
    cfg = load_config(
        "grpo", ["model.tiny_arch=moe", "actor.moe.routing_replay=rollout", "rollout.name=sglang"]
    )
    assert cfg.rollout.name == "sglang" and cfg.actor.moe.routing_replay == "rollout"
