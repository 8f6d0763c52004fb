"""Role workers: the Ray-actor classes a recipe composes into the processes of its resource pools.

* `ActorWorker` -- the policy: old log-probs, PPO updates, SFT warm-start steps, checkpoints, HF export, and
  its weights out (in process to a colocated rollout role, or broadcast in buckets to a rollout pool)
* `RefWorker` -- the frozen reference policy's log-probs
* `CriticWorker` -- values and value-loss updates
* `RewardWorker` -- rule-based outcome scores of decoded responses
* `RolloutWorker` -- a rollout replica per rank; colocated it shares the actor (``trainer=Shared("actor")``,
  `hybrid_roles`: the hybrid engine), on its own pool it receives weights over a weight-sync group (driven from
  the controller by `workers.weight_sync.WeightSync`)

Each is a `controller.Worker` built from the config dataclasses in `workers.config`; heavy setup happens in
``init_model()`` (call it on the group once, in build order). `workers.roles.common` holds what the engine
roles share. Other roles live beside what they serve: the agent env (`workers.agents.env_worker.EnvWorker`,
sharing a rollout role) and the PRM (`workers.prm.worker.PRMWorker`).
"""

from workers.roles.actor import ActorWorker
from workers.roles.compose import hybrid_groups, hybrid_roles
from workers.roles.critic import CriticWorker
from workers.roles.reference import RefWorker
from workers.roles.reward import RewardWorker
from workers.roles.rollout import RolloutWorker

__all__ = [
    "ActorWorker",
    "CriticWorker",
    "RefWorker",
    "RewardWorker",
    "RolloutWorker",
    "hybrid_groups",
    "hybrid_roles",
]
