"""dslab's benchmark models as plain ``nn.Module``s on the op set of :mod:`dslab.models.ops`:
BERT for pretraining (:mod:`dslab.models.bert`), the GPT-2 language model
(:mod:`dslab.models.gpt2`), GPT-2-MoE (:mod:`dslab.models.gpt2_moe`) and AlphaFold 2's Evoformer
stack (:mod:`dslab.models.evoformer`), each built with ``kernels="dslab"`` (dslab's fused ops) or
``kernels="torch"`` (PyTorch's own; the Evoformer also takes ``"sdpa"``); BERT and GPT-2 convert
from/to HuggingFace state dicts (:mod:`dslab.models.hf_mapping`)."""

from dslab.models.bert import BertConfig, BertForPreTraining, bert_base, bert_large, bert_tiny
from dslab.models.evoformer import (
    EvoformerConfig, EvoformerStack, evoformer_finetune, evoformer_flops, evoformer_initial, evoformer_tiny,
)
from dslab.models.gpt2 import GPT2Config, GPT2LMHeadModel, gpt2_124m, gpt2_355m, gpt2_774m, gpt2_1558m, gpt2_tiny
from dslab.models.gpt2_moe import GPT2MoEConfig, GPT2MoELMHeadModel, gpt2_moe_124m_8e, gpt2_moe_tiny
from dslab.models.ops import KERNEL_SETS, OpSet, op_set

__all__ = [
    "KERNEL_SETS",
    "BertConfig",
    "BertForPreTraining",
    "EvoformerConfig",
    "EvoformerStack",
    "GPT2Config",
    "GPT2LMHeadModel",
    "GPT2MoEConfig",
    "GPT2MoELMHeadModel",
    "OpSet",
    "bert_base",
    "bert_large",
    "bert_tiny",
    "evoformer_finetune",
    "evoformer_flops",
    "evoformer_initial",
    "evoformer_tiny",
    "gpt2_124m",
    "gpt2_1558m",
    "gpt2_355m",
    "gpt2_774m",
    "gpt2_moe_124m_8e",
    "gpt2_moe_tiny",
    "gpt2_tiny",
    "op_set",
]
