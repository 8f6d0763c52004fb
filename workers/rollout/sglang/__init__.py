"""SGLang rollout adapter: ``SGLangRollout``, a ``RolloutEngine`` over ``sglang.Engine`` (CUDA, or SGLang's
CPU engine for tests and CI: ``make sglang-cpu``, ``device="cpu"``).

sglang is imported lazily (only when an engine is built), so this package imports without it; then
``SGLangRollout(config)`` raises ``ImportError`` naming ``make sglang-cpu`` / ``pip install -e '.[sglang]'``.
Run for real against sglang 0.5.20 (``tests/workers/rollout/test_sglang_integration.py``); the
weight-update session of >= 0.5.21 (``begin_weight_update`` / ``end_weight_update``) was read from the
0.5.21 wheel. ``lifecycle.py``: the engine's processes, death, idle state and shutdown.

SGLang API this adapter was written against (sglang >= 0.5; the snapshot of
``python/sglang/srt/entrypoints/engine.py`` read is the 0.5.7 line: it pins sgl-kernel 0.3.20 and
flashinfer 0.5.3; the repository snapshot was read through a code index, not a git checkout, so no
single commit hash covers every file -- the per-file commits are listed below where the index gave one):

* ``python/sglang/srt/entrypoints/engine.py`` (0.5.7 line; the older ``18bfdd16`` version too):
  ``Engine(**ServerArgs fields)``;
  ``Engine.generate(prompt=None, sampling_params=None, input_ids=None, ..., return_logprob=False,
  logprob_start_len=None, top_logprobs_num=None, ..., stream=False, ..., rid=None)`` -> dict, or a
  list for a batch; ``async Engine.async_generate(...)`` with the same arguments;
  ``Engine.update_weights_from_tensor(named_tensors, load_format=None, flush_cache=True)`` which
  serializes ``named_tensors`` with ``MultiprocessingSerializer`` once per TP rank
  (``[serialize(named_tensors) for _ in range(tp_size)]``) except for
  ``load_format="flattened_bucket"``, where the caller's list (one serialized
  ``{"flattened_tensor", "metadata"}`` payload per TP rank) is passed through as is;
  ``Engine.release_memory_occupation(tags: Optional[List[str]] = None)`` /
  ``Engine.resume_memory_occupation(tags=None)``; ``Engine.flush_cache()``; ``Engine.shutdown()``.
* ``python/sglang/srt/managers/io_struct.py``: ``UpdateWeightsFromTensorReqInput(
  serialized_named_tensors, load_format=None, flush_cache=True, abort_all_requests=False,
  weight_version=None)``; ``ReleaseMemoryOccupationReqInput(tags=None)``;
  ``GenerateReqInput`` normalisation (``logprob_start_len`` default -1; n > 1 expands each request
  in place: a, a, b, b).
* ``python/sglang/srt/managers/tokenizer_manager.py`` (``_handle_batch_output``,
  ``convert_logprob_style``, ``detokenize_logprob_tokens``): output dict shape, see ``convert.py``;
  ``update_weights_from_tensor`` returns ``(success: bool, message: str)``.
* ``python/sglang/srt/managers/schedule_batch.py``: ``FINISH_MATCHED_TOKEN`` / ``FINISH_MATCHED_STR``
  -> ``{"type": "stop", "matched": ...}``, ``FINISH_LENGTH`` -> ``{"type": "length", "length": n}``,
  ``FINISH_ABORT`` -> ``{"type": "abort", "message": ...}``.
* ``python/sglang/srt/sampling/sampling_params.py`` (commit ``00c17caf``): ``max_new_tokens``,
  ``stop``, ``stop_token_ids``, ``temperature``, ``top_p``, ``top_k`` (-1 = all), ``n``,
  ``sampling_seed`` (only used with ``ServerArgs.enable_deterministic_inference``).
* ``python/sglang/srt/weight_sync/tensor_bucket.py`` (commit ``0cbf0687``):
  ``FlattenedTensorMetadata(name, shape, dtype, start_idx, end_idx, numel)`` with byte indices
  into a ``uint8`` buffer; ``FlattenedTensorBucket.supports_multi_dtypes``.
* ``python/sglang/srt/constants.py``: memory tags ``"kv_cache"``, ``"weights"``, ``"cuda_graph"``;
  the scheduler treats ``tags=None`` as all of them and asserts the server is idle.
* routed experts (R3), read from the installed 0.5.20 wheel: see the notes in ``convert.py``
  (``enable_return_routed_experts``, ``return_routed_experts``, ``meta_info["routed_experts"]``).
* ``python/sglang/srt/server_args.py``: ``model_path``, ``dtype``, ``mem_fraction_static``,
  ``tp_size``, ``random_seed``, ``base_gpu_id``, ``log_level``, ``attention_backend``,
  ``enable_memory_saver``, ``enable_deterministic_inference``, ``trust_remote_code``.
"""

from workers.rollout.sglang.convert import (
    RouteLayout,
    decode_routed_experts,
    expand_requests,
    output_to_generation,
    parse_finish_reason,
    to_sglang_sampling_params,
)
from workers.rollout.sglang.lifecycle import SGLangEngineDied
from workers.rollout.sglang.rollout import (
    INSTALL_HINT,
    SGLangRollout,
    SGLangRolloutConfig,
    config_from_dict,
    import_sglang,
)

__all__ = [
    "INSTALL_HINT",
    "RouteLayout",
    "SGLangEngineDied",
    "SGLangRollout",
    "SGLangRolloutConfig",
    "config_from_dict",
    "decode_routed_experts",
    "expand_requests",
    "import_sglang",
    "output_to_generation",
    "parse_finish_reason",
    "to_sglang_sampling_params",
]
