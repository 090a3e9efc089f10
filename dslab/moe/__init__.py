"""DeepSpeed's mixture-of-experts layer on dslab's kernels (:class:`dslab.moe.layer.MoE`).

:mod:`dslab.moe.layer` holds the ``MoE`` module; :mod:`dslab.moe.gating` the top-k gate on the
``moe_gating`` kernel; :mod:`dslab.moe.sharded_moe` the dispatch (``MOELayer``) and the
plain-PyTorch reference gating (``top1gating``, ``top2gating``); :mod:`dslab.moe.experts` the
stacked experts; :mod:`dslab.moe.expert_parallel` the all_to_all exchange; :mod:`dslab.moe.groups`
the process groups; :mod:`dslab.moe.utils` the parameter helpers.
"""

from dslab.moe.experts import MLPExpert
from dslab.moe.layer import MoE
from dslab.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

__all__ = ["MLPExpert", "MoE", "is_moe_param", "split_params_into_different_moe_groups_for_optimizer"]
