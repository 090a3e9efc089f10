"""dslab's benchmark models as plain ``nn.Module``s on the op set of :mod:`dslab.models.ops`:
BERT for pretraining (:mod:`dslab.models.bert`) and the GPT-2 language model
(:mod:`dslab.models.gpt2`), each built with ``kernels="dslab"`` (dslab's fused ops) or
``kernels="torch"`` (PyTorch's own), and convertible from/to HuggingFace state dicts
(:mod:`dslab.models.hf_mapping`)."""

from dslab.models.bert import BertConfig, BertForPreTraining, bert_base, bert_large, bert_tiny
from dslab.models.gpt2 import GPT2Config, GPT2LMHeadModel, gpt2_124m, gpt2_355m, gpt2_774m, gpt2_1558m, gpt2_tiny
from dslab.models.ops import KERNEL_SETS, OpSet, op_set

__all__ = [
    "KERNEL_SETS",
    "BertConfig",
    "BertForPreTraining",
    "GPT2Config",
    "GPT2LMHeadModel",
    "OpSet",
    "bert_base",
    "bert_large",
    "bert_tiny",
    "gpt2_124m",
    "gpt2_1558m",
    "gpt2_355m",
    "gpt2_774m",
    "gpt2_tiny",
    "op_set",
]
