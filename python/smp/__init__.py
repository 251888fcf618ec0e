"""smp: pipeline, tensor and sharded-optimizer parallelism for unmodified PyTorch models.

`import smp` registers the "smp" c10d backend with torch.distributed. The API mirrors
SMP v1 (`import smdistributed.modelparallel.torch as smp`).
"""

# _checkout (first): in a checkout, smp.passes is this checkout's passes/. amp.GradScaler; nn: SMP
# v1's distributed modules (smp.nn); ops and cp_ops register the TP and CP ops' fake kernels
from smp import _checkout, amp, cp_ops, nn, ops  # noqa: F401
from smp._backend import BACKEND_NAME, backend_stats
from smp._backend import register as _register_backend
from smp.checkpoint import load, resume_from_checkpoint, save, save_checkpoint, wait_for_checkpoint
from smp.comm import (
    allgather,
    barrier,
    broadcast,
    dp_barrier,
    mp_barrier,
    pp_barrier,
    rdp_barrier,
    recv_from,
    send,
    tp_barrier,
)
from smp.compat import is_tracing, state
from smp.config import Config
from smp.creation import model_creation, tensor_parallelism
from smp.data import data_loader, data_seed, sampler, set_seed, tensor_parallel_seed
from smp.engine.delayed_init import delay_param_initialization
from smp.model import DistributedModel, set_activation_checkpointing
from smp.optimizer import DistributedOptimizer
from smp.parallel_state import (
    cp_rank,
    cp_size,
    dp_rank,
    dp_size,
    ep_rank,
    ep_size,
    get_cp_group,
    get_cp_process_group,
    get_dp_group,
    get_dp_process_group,
    get_ep_group,
    get_ep_process_group,
    get_mp_group,
    get_mp_process_group,
    get_pp_group,
    get_pp_process_group,
    get_rdp_group,
    get_rdp_process_group,
    get_sdp_group,
    get_sdp_process_group,
    get_tp_group,
    get_tp_process_group,
    get_world_process_group,
    init,
    is_initialized,
    local_rank,
    local_size,
    mp_rank,
    mp_size,
    num_microbatches,
    pp_rank,
    pp_size,
    rank,
    rdp_rank,
    rdp_size,
    sdp_rank,
    sdp_size,
    size,
    tp_rank,
    tp_size,
)
from smp.pipeline.partitioning import partition, set_partition
from smp.planner import plan as plan  # the config planner (python -m smp.plan is smp/plan.py)
from smp.services.timeline import write as write_timeline
from smp.state.rank_state import register as register_stateful
from smp.step import StepOutput, step
from smp.tensor_parallel.marks import set_tensor_parallelism
from smp.tensor_parallel.registration import tp_register, tp_register_with_module
from smp.topology import CommGroup, RankType, Topology

__version__ = "0.1.0"

_register_backend()

WORLD = CommGroup.WORLD
PP_GROUP = CommGroup.PP_GROUP
TP_GROUP = CommGroup.TP_GROUP
DP_GROUP = CommGroup.DP_GROUP
RDP_GROUP = CommGroup.RDP_GROUP
MP_GROUP = CommGroup.MP_GROUP
SDP_GROUP = CommGroup.SDP_GROUP
EP_GROUP = CommGroup.EP_GROUP
CP_GROUP = CommGroup.CP_GROUP
WORLD_RANK = RankType.WORLD_RANK
MP_RANK = RankType.MP_RANK
DP_RANK = RankType.DP_RANK
PP_RANK = RankType.PP_RANK
TP_RANK = RankType.TP_RANK
RDP_RANK = RankType.RDP_RANK
SDP_RANK = RankType.SDP_RANK
CP_RANK = RankType.CP_RANK

__all__ = [
    "delay_param_initialization",
    "amp",
    "ops",
    "BACKEND_NAME",
    "CP_GROUP",
    "CP_RANK",
    "DP_GROUP",
    "DP_RANK",
    "MP_GROUP",
    "MP_RANK",
    "PP_GROUP",
    "PP_RANK",
    "TP_RANK",
    "RDP_RANK",
    "RDP_GROUP",
    "SDP_GROUP",
    "SDP_RANK",
    "EP_GROUP",
    "TP_GROUP",
    "WORLD",
    "WORLD_RANK",
    "CommGroup",
    "Config",
    "DistributedModel",
    "DistributedOptimizer",
    "RankType",
    "StepOutput",
    "Topology",
    "__version__",
    "allgather",
    "backend_stats",
    "barrier",
    "broadcast",
    "data_loader",
    "data_seed",
    "dp_barrier",
    "dp_rank",
    "dp_size",
    "get_dp_group",
    "get_dp_process_group",
    "get_mp_group",
    "get_mp_process_group",
    "get_pp_group",
    "get_pp_process_group",
    "get_rdp_group",
    "get_rdp_process_group",
    "get_tp_group",
    "get_tp_process_group",
    "get_world_process_group",
    "init",
    "is_initialized",
    "is_tracing",
    "model_creation",
    "register_stateful",
    "state",
    "load",
    "resume_from_checkpoint",
    "save",
    "save_checkpoint",
    "wait_for_checkpoint",
    "local_rank",
    "local_size",
    "mp_barrier",
    "mp_rank",
    "mp_size",
    "num_microbatches",
    "partition",
    "pp_barrier",
    "pp_rank",
    "pp_size",
    "rank",
    "rdp_barrier",
    "rdp_rank",
    "rdp_size",
    "sdp_rank",
    "sdp_size",
    "cp_rank",
    "cp_size",
    "get_cp_group",
    "get_cp_process_group",
    "get_sdp_group",
    "get_sdp_process_group",
    "ep_rank",
    "ep_size",
    "get_ep_group",
    "get_ep_process_group",
    "recv_from",
    "sampler",
    "send",
    "set_activation_checkpointing",
    "set_partition",
    "set_seed",
    "size",
    "step",
    "set_tensor_parallelism",
    "tensor_parallelism",
    "tensor_parallel_seed",
    "tp_barrier",
    "tp_register",
    "tp_register_with_module",
    "nn",
    "tp_rank",
    "tp_size",
    "write_timeline",
]
