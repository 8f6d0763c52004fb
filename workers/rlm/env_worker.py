"""The RLM-REPL environment role (``env``): many RLM trajectories per worker, one asyncio loop, one sandbox.

Two workers share the environment logic (`RLMEnvMixin`); they differ only in where the policy engine
lives and therefore how its weights arrive:

* ``RLMEnvWorker(model, rollout, env)`` -- the ``env`` role on its own resource pool (disaggregated
  placement). It *is* a `workers.roles.rollout.RolloutWorker`: one rollout replica per rank (native
  engine or SGLang), and new policy weights arrive exactly as for any rollout group, over the
  weight-sync process group: ``sync_weights_disaggregated(actor_wg, env_wg)`` (``init_weight_sync`` /
  ``receive_weights`` are inherited). ``generate_sequences(data)`` runs RLM trajectories (so the env
  group can stand in for the rollout group of a recipe); ``generate_rlm`` is the same call.
* ``RLMActorRolloutWorker(model, actor, rollout, env)`` -- colocated placement: the hybrid actor-rollout
  worker (FSDP2 trainer + rollout replica in one process) plus ``generate_rlm(data)``. Weights reach
  the replica by the existing in-process path (``sync_weights``); ``generate_sequences`` stays plain
  single-turn generation.

``generate_rlm(data)`` / ``RLMEnvWorker.generate_sequences(data)`` (``ROLLOUT_DP_DISPATCH``: one
contiguous chunk of prompts per rank, outputs concatenated in rank order; ranks may return different
row counts, e.g. with children as rows):

* input, per row: ``non_tensor_batch["raw_prompt"]`` (chat messages; the query is the last user
  message -- or ``extra_info["question"]``), ``["extra_info"]["context"]`` (the REPL's ``context``:
  a str or list of str), ``["uid"]`` (generated when absent) and any other columns (copied to every
  output row of that prompt, children included). Tensors of the input are not used (the env builds
  its own prompts from the chat template).
* ``meta_info``: ``n`` samples per prompt (group sampling; rows come back a,a,b,b), ``temperature``,
  ``top_p``, ``top_k``, ``do_sample``, ``validate`` (defaults from the RolloutConfig as in
  `workers.roles.rollout.rollout_sampling_meta`), ``seed`` (sample j of the chunk draws from
  ``seed + j``), ``train_children`` (overrides ``env.train_children`` for this call).
* all trajectories of the chunk run concurrently on the worker's event loop (at most
  ``env.max_concurrent`` roots at once), so their model turns and ``llm_query`` sub-calls batch in the
  engine; every trajectory has its own REPL in the worker's sandbox.
* output: `workers.rlm.trajectory_batch.trajectories_to_dataproto` rows (roots, plus children when
  ``env.train_children``) with the BATCH_LAYOUT tensors and ``uid``/``depth``/``parent_id``/``answer``/
  ``status``/``trajectory`` columns; ``meta_info["metrics"]``: ``env/turns/mean``,
  ``env/subcalls/mean``, ``env/children/mean``, ``env/finished_frac``, ``env/errors``,
  ``env/status/<status>``, ``env/response_length/mean``, ``env/trajectories_per_s``,
  ``env/turns_per_s``, ``env/gen_s_per_turn``, ``env/exec_s_per_turn``, ``timing_s/gen`` (this rank's
  chunk; a group call reports rank 0's, as for rollouts).

``llm_query`` sub-calls go to the policy engine, or to a frozen model when ``env.sub_model_path`` is
set (a second native engine built on the same device, never updated). Tests and benchmarks may pass
``policy_factory(tokenizer) -> GenerateFn`` instead of building an engine (a scripted policy).
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from controller import Dispatch, register
from dataproto import DataProto
from workers.config import ActorConfig, ModelConfig, RolloutConfig
from workers.rlm.agent import AgentConfig, AgentResult, EngineLLM, RLMAgent, normalize_context
from workers.rlm.env_base import AgentEnvBase
from workers.rlm.protocol import STATUSES
from workers.rlm.trajectory_batch import trajectories_to_dataproto, trajectory_json
from workers.roles.actor_rollout import ActorRolloutWorker
from workers.roles.rollout import PAD_ROWS_KEY, ROLLOUT_DP_DISPATCH, RolloutWorker, rollout_sampling_meta
from workers.sandbox import SandboxConfig

__all__ = ["RLMActorRolloutWorker", "RLMEnvConfig", "RLMEnvMixin", "RLMEnvWorker", "query_of"]

# Output columns written by trajectories_to_dataproto; input columns of the same name are not copied.
_OWN_COLUMNS = {
    "uid",
    "traj_id",
    "root_id",
    "depth",
    "parent_id",
    "answer",
    "root_answer",
    "status",
    "num_turns",
    "truncated",
    "trajectory",
}


@dataclass
class RLMEnvConfig:
    """The env role's settings (the agent's own limits are in ``agent``)."""

    agent: AgentConfig = field(default_factory=AgentConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    max_prompt_length: int | None = None  # P of the batch (None: rollout.prompt_length)
    max_response_length: int | None = None  # R: all turns + observations (None: rollout.response_length)
    train_children: bool = False  # child trajectories become rows (else they are only executed)
    mask_truncated: bool = False  # zero the loss mask of rows cut at P + R
    max_concurrent: int = 64  # root trajectories in flight per worker
    sub_model_path: str | None = None  # frozen model answering llm_query (None: the policy engine)
    sub_max_num_seqs: int = 64
    include_json: bool = True  # non_tensor_batch["trajectory"]
    jsonl_dir: str | None = None  # append every call's trajectories to <dir>/env_rank<r>.jsonl

    def __post_init__(self):
        if self.max_concurrent < 1:
            raise ValueError(f"RLMEnvConfig.max_concurrent must be >= 1, got {self.max_concurrent}")


def query_of(raw_prompt, extra_info) -> str:
    """The query of a dataset row: the last user message of ``raw_prompt`` (chat messages), else
    ``extra_info["question"]``, else ``str(raw_prompt)``."""
    msgs = raw_prompt.tolist() if isinstance(raw_prompt, np.ndarray) else raw_prompt
    if isinstance(msgs, (list, tuple)):
        for m in reversed(list(msgs)):
            if isinstance(m, dict) and m.get("role") == "user":
                return str(m.get("content", ""))
    if isinstance(extra_info, dict) and extra_info.get("question"):
        return str(extra_info["question"])
    if isinstance(msgs, str):
        return msgs
    raise ValueError(f"cannot find a query in raw_prompt={raw_prompt!r}")


class RLMEnvMixin(AgentEnvBase):
    """RLM rollouts for a worker that has ``tokenizer``, ``rollout_engine`` (or a policy factory),
    ``rollout_config``, ``rank`` and ``tag``."""

    loop_name = "rlm-env"

    def _env_init(self, env: RLMEnvConfig | None, policy_factory=None) -> None:
        self._env_base_init(env or RLMEnvConfig(), policy_factory)
        self._sub_llm: EngineLLM | None = None
        self._sub_engine = None
        self.env_calls = 0

    # -- pieces, built on first use ---------------------------------------------------------------------

    def _env_lengths(self) -> tuple[int, int]:
        env, r = self.env_config, self.rollout_config
        return env.max_prompt_length or r.prompt_length, env.max_response_length or r.response_length

    def _env_policy(self) -> EngineLLM:
        policy = super()._env_policy()
        if self.env_config.sub_model_path and self._sub_llm is None:
            self._sub_llm = self._build_sub_llm()
        return policy

    def _build_sub_llm(self) -> EngineLLM:
        from workers.engine.distributed import default_device
        from workers.models import load_tokenizer
        from workers.rollout.native import EngineConfig, NativeEngine

        path = self.env_config.sub_model_path
        tok = load_tokenizer(path)
        cfg = EngineConfig(
            max_num_seqs=self.env_config.sub_max_num_seqs,
            device=str(default_device()),
            seed=1_000_003 * (self.rollout_config.seed + 7) + self.rank,
        )
        self._sub_engine = NativeEngine.from_pretrained(path, tokenizer=tok, config=cfg)
        return EngineLLM(self._sub_engine, tok, name="sub")

    # -- the rollout ------------------------------------------------------------------------------------

    def _agent_config(self, settings: dict) -> AgentConfig:
        P, R = self._env_lengths()
        return self._sampled(self.env_config.agent, settings, P + R)

    @staticmethod
    async def _run_job(agent: RLMAgent, job: dict) -> AgentResult:
        return await agent.run(
            job["query"],
            job["context"],
            uid=job["uid"],
            traj_id=job["traj_id"],
            seed=job["seed"],
            metadata={"sample": job["sample"]},
        )

    def _rlm_generate(self, data: DataProto) -> DataProto:
        t0 = time.perf_counter()
        if not isinstance(data, DataProto):
            raise TypeError(f"{self.tag}: RLM rollout takes a DataProto, got {type(data).__name__}")
        meta = dict(data.meta_info)
        pad_rows = int(meta.pop(PAD_ROWS_KEY, 0))
        settings = rollout_sampling_meta(self.rollout_config, meta)
        n = settings["n"]
        seed = meta.get("seed", self.rollout_config.seed * 2**32 + self.rank)
        num_rows = len(data) - pad_rows
        nt = data.non_tensor_batch
        for key in ("extra_info",):
            if key not in nt and num_rows:
                raise KeyError(
                    f"{self.tag}: RLM rollout needs non_tensor_batch[{key!r}] (with 'context'); "
                    f"the batch has {sorted(nt)}"
                )
        uids = list(nt["uid"]) if "uid" in nt else [uuid.uuid4().hex for _ in range(len(data))]
        jobs = []
        for i in range(num_rows):
            extra = nt["extra_info"][i]
            extra = extra if isinstance(extra, dict) else {}
            raw = nt["raw_prompt"][i] if "raw_prompt" in nt else None
            query = query_of(raw, extra)
            context = normalize_context(extra.get("context"))
            uid = str(uids[i])
            for k in range(n):
                j = len(jobs)
                jobs.append(
                    {
                        "row": i,
                        "sample": k,
                        "query": query,
                        "context": context,
                        "uid": uid,
                        "traj_id": f"{uid.replace('/', '_')}.{k}",
                        "seed": None if seed is None else int(seed) + j,
                    }
                )

        agent_cfg = self._agent_config(settings)
        policy = self._env_policy()
        agent = RLMAgent(policy, self._env_sandbox(), agent_cfg, sub_llm=self._sub_llm)
        results = self._run_agents(lambda job: self._run_job(agent, job), jobs)
        elapsed = time.perf_counter() - t0
        self.env_calls += 1

        trajectories, sources = [], []
        for job, res in zip(jobs, results):
            for t in res.trajectories:
                trajectories.append(t)
                sources.append(job["row"])
        extra_cols = {k: [v[r] for r in sources] for k, v in nt.items() if k not in _OWN_COLUMNS and num_rows}
        if not num_rows:  # a placeholder chunk: no rows, but the same columns as the other ranks
            extra_cols = {k: [] for k in nt if k not in _OWN_COLUMNS}
        P, R = self._env_lengths()
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        metrics = self._env_metrics(results, elapsed)
        eos = list(getattr(self._env_engine(), "eos_token_ids", None) or [self.tokenizer.eos_token_id])
        out_meta = {
            **meta,
            "temperature": agent_cfg.temperature if agent_cfg.temperature > 0 else 1.0,
            "n": n,
            "eos_token_id": eos,
            "pad_token_id": pad,
            "timing_s/gen": elapsed,
            "metrics": metrics,
        }
        out = trajectories_to_dataproto(
            trajectories,
            max_prompt_length=P,
            max_response_length=R,
            pad_token_id=pad,
            train_children=bool(meta.get("train_children", self.env_config.train_children)),
            mask_truncated=self.env_config.mask_truncated,
            extra=extra_cols,
            meta_info=out_meta,
            include_json=self.env_config.include_json,
        )
        if self.env_config.jsonl_dir and trajectories:
            os.makedirs(self.env_config.jsonl_dir, exist_ok=True)
            path = os.path.join(self.env_config.jsonl_dir, f"env_rank{self.rank}.jsonl")
            with open(path, "a", encoding="utf-8") as f:
                for t in trajectories:
                    f.write(trajectory_json(t) + "\n")
        out.meta_info["metrics"]["env/response_length/mean"] = (
            float(out.batch["attention_mask"][:, P:].sum(-1).float().mean()) if len(out) else 0.0
        )
        return out

    def _env_metrics(self, results: list[AgentResult], elapsed: float) -> dict[str, float]:
        roots = [r.root for r in results]
        every = [t for r in results for t in r.trajectories]
        nroot = max(len(roots), 1)
        turns_all = sum(len(t.turns) for t in every)
        subcalls = [sum(len(t.metadata.get("subcalls", [])) for t in r.trajectories) for r in results]
        gen_s = sum(t.timings.get("gen_s", 0.0) for t in every)
        exec_s = sum(t.timings.get("exec_s", 0.0) for t in every)
        m = {
            "env/num_roots": float(len(roots)),
            "env/num_trajectories": float(len(every)),
            "env/turns/mean": sum(len(t.turns) for t in roots) / nroot,
            "env/turns/max": float(max((len(t.turns) for t in roots), default=0)),
            "env/subcalls/mean": sum(subcalls) / nroot,
            "env/children/mean": (len(every) - len(roots)) / nroot,
            "env/depth/max": float(max((t.depth for t in every), default=0)),
            "env/finished_frac": sum(t.status == "finished" for t in roots) / nroot,
            "env/errors": float(sum(t.status == "error" for t in every)),
            "env/trajectories_per_s": len(roots) / elapsed if elapsed > 0 else 0.0,
            "env/turns_per_s": turns_all / elapsed if elapsed > 0 else 0.0,
            "env/gen_s_per_turn": gen_s / max(turns_all, 1),
            "env/exec_s_per_turn": exec_s / max(turns_all, 1),
            "timing_s/gen": elapsed,
        }
        for s in STATUSES:
            if s != "running":
                m[f"env/status/{s}"] = float(sum(t.status == s for t in roots))
        return m

    # -- group methods ----------------------------------------------------------------------------------

    @register(Dispatch.ONE_TO_ALL)
    def env_info(self) -> dict:
        """This rank's sandbox isolation report and counters (``workers.sandbox`` README terms)."""
        sb = self._env_sandbox()
        return {
            "rank": self.rank,
            "isolation": sb.isolation_report(),
            "calls": self.env_calls,
            "repls_open": sb.num_repls,
        }


class RLMEnvWorker(RLMEnvMixin, RolloutWorker):
    """The ``env`` role on its own pool: a rollout replica per rank + a REPL sandbox; weights arrive over
    the weight-sync group (``sync_weights_disaggregated(actor_wg, env_wg)``)."""

    def __init__(
        self,
        model: ModelConfig,
        rollout: RolloutConfig,
        env: RLMEnvConfig | None = None,
        policy_factory=None,
    ):
        super().__init__(model, rollout)
        self._env_init(env, policy_factory)

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Tokenizer + this rank's rollout engine (only the tokenizer with a ``policy_factory``) + sandbox."""
        if self._policy_factory is not None:
            self._load_tokenizer_only()
        else:
            super().init_model()
        self._env_sandbox()

    @register(ROLLOUT_DP_DISPATCH)
    def generate_sequences(self, data: DataProto) -> DataProto:
        """RLM trajectories for this rank's chunk of prompts (see the module docstring)."""
        return self._rlm_generate(data)

    @register(ROLLOUT_DP_DISPATCH)
    def generate_rlm(self, data: DataProto) -> DataProto:
        """Same as ``generate_sequences``."""
        return self._rlm_generate(data)


class RLMActorRolloutWorker(RLMEnvMixin, ActorRolloutWorker):
    """Colocated placement: the hybrid actor-rollout worker plus ``generate_rlm``; the policy weights reach
    the rollout replica in process (``sync_weights``)."""

    def __init__(
        self,
        model: ModelConfig,
        actor: ActorConfig,
        rollout: RolloutConfig,
        env: RLMEnvConfig | None = None,
    ):
        super().__init__(model, actor, rollout)
        self._env_init(env)

    def _env_before_generate(self) -> None:
        self._offload_trainer()

    @register(ROLLOUT_DP_DISPATCH)
    def generate_rlm(self, data: DataProto) -> DataProto:
        """RLM trajectories for this rank's chunk of prompts with the current rollout weights."""
        self._require_rollout("generate_rlm")
        return self._rlm_generate(data)
