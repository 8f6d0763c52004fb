"""RefWorker: the frozen reference policy's log-probs (for the KL loss or the in-reward KL penalty).

A forward-only engine (no optimizer, parameters frozen), FSDP2-sharded over the group when it has more than one
rank. Usually colocated with the actor in the same processes (``create_colocated_worker_cls``); the two hold
separate engines, and the reference never changes.
"""

from __future__ import annotations

from controller import Dispatch, register
from dataproto import DataProto
from workers.config import ModelConfig, RolloutConfig
from workers.engine import FSDPEngine
from workers.models import load_tokenizer
from workers.roles.common import FORWARD_KEYS, EngineRoleWorker, engine_config, log_prob_settings


class RefWorker(EngineRoleWorker):
    def __init__(self, model: ModelConfig, rollout: RolloutConfig):
        self.model_config = model
        self.rollout_config = rollout
        self.engine: FSDPEngine | None = None
        self.tokenizer = None

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.init_distributed()
        self.engine = FSDPEngine(engine_config(self.model_config, optim=None))
        self.tokenizer = load_tokenizer(
            self.model_config.path, trust_remote_code=self.model_config.trust_remote_code
        )

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """``ref_log_prob`` [B, R] of the responses at ``meta_info["temperature"]`` (default rollout.temperature,
        the same temperature the actor's log-probs use); micro-batching from rollout.log_prob_*."""
        engine = self._require_engine("compute_ref_log_prob")
        self._require_keys(data, FORWARD_KEYS, "compute_ref_log_prob")
        temperature, micro = log_prob_settings(self.tag, self.rollout_config, data.meta_info)
        out = engine.compute_log_prob(self._select(data, FORWARD_KEYS), temperature=temperature, **micro)
        return DataProto.from_dict({"ref_log_prob": out["log_probs"]}, meta_info={"temperature": temperature})
