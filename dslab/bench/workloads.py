"""What each model family trains on in a benchmark: the model, a synthetic batch made on the
device, and the loss call; plus the matching HuggingFace model for the ``hf`` arm.

Families (:data:`dslab.bench.suite.FAMILIES`):

- ``bert``: :class:`dslab.models.bert.BertForPreTraining`; hf: transformers' ``BertForPreTraining``.
- ``gpt2``: :class:`dslab.models.gpt2.GPT2LMHeadModel`; hf: transformers' ``GPT2LMHeadModel``.
- ``gpt2_moe``: :class:`dslab.models.gpt2_moe.GPT2MoELMHeadModel`; hf: transformers'
  ``GPT2LMHeadModel`` with a Mixtral sparse-MoE block in every other layer
  (:class:`dslab.bench.hf_moe.HFGPT2MoE`).
- ``moe_layer``: one MoE layer alone (:class:`dslab.bench.moe_layer.MoELayerModel`); hf: the
  Mixtral block alone (:class:`dslab.bench.hf_moe.HFMoELayer`).
- ``llama``: :class:`dslab.models.llama.LlamaForCausalLM` (Llama 3.2's 1B and 3B shapes); hf:
  transformers' ``LlamaForCausalLM`` (SDPA attention), which the ``liger`` arm patches with
  Liger-Kernel's ops (:mod:`dslab.bench.liger`).
- ``evoformer``: AlphaFold 2's Evoformer stack and a loss
  (:class:`dslab.bench.evoformer.EvoformerTrainModel`); no hf model (transformers has no
  Evoformer), but an ``sdpa`` kernel set. Its cases take their shape from the preset: one sample
  is one crop of ``n_seq`` MSA rows x ``n_res`` residues, and its tokens are its ``n_seq * n_res``
  MSA positions.

Data is synthetic and fixed per case (one batch, reused every step), drawn from a seeded
generator on the device:

- BERT: random token ids, two segments (token type 0 then 1), no padding; 15% of positions are
  masked for MLM (of those, 80% replaced by [MASK], 10% by a random token, 10% kept) with labels
  at the masked positions only; NSP labels are random.
- GPT-2 and GPT-2-MoE: random token ids; labels are the inputs (the model shifts them).
- MoE layer: hidden states ``[micro_batch, seq_len, hidden]`` ~ N(0, 1) in the precision's dtype
  (bf16/fp16, else fp32).
- Evoformer: ``m``, ``z`` ~ N(0, 1) in the precision's dtype, masks padding the last 1/8 of the
  residues and 1/4 of the MSA rows of every crop (:func:`dslab.bench.evoformer.evoformer_batch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from dslab.bench.suite import ARM_FAMILIES, FAMILIES, CaseConfig, SuiteConfig, select_cases

MASK_TOKEN_ID = 103
MLM_PROBABILITY = 0.15
# Where each family's presets (config factories) live.
PRESET_MODULES = {"bert": "dslab.models.bert", "gpt2": "dslab.models.gpt2", "gpt2_moe": "dslab.models.gpt2_moe",
                  "moe_layer": "dslab.bench.moe_layer", "evoformer": "dslab.models.evoformer",
                  "llama": "dslab.models.llama"}
LANGUAGE_MODELS = ("gpt2", "gpt2_moe", "llama")
MOE_FAMILIES = ("gpt2_moe", "moe_layer")
HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Workload:
    """One case of a suite, ready to build models and batches for."""

    family: str
    preset: str
    case: CaseConfig
    model_options: dict
    seed: int
    precision: str = "fp32"

    @property
    def data_description(self) -> str:
        if self.family == "bert":
            return ("synthetic: uniform random token ids, 2 segments, no padding, 15% MLM masking "
                    "(80/10/10), random NSP labels; one fixed batch per case made on the device")
        if self.family == "moe_layer":
            return ("synthetic: hidden states ~ N(0, 1) [micro_batch, seq_len, hidden] in the precision's dtype; "
                    "one fixed batch per case made on the device")
        if self.family == "evoformer":
            return ("synthetic: MSA m [micro_batch, N_seq, N_res, c_m] and pair z [micro_batch, N_res, N_res, c_z] "
                    "~ N(0, 1) in the precision's dtype; masks pad the last 1/8 of the residues and 1/4 of the MSA "
                    "rows of each crop; loss = mean square of the outputs over their real entries; one fixed "
                    "batch per case made on the device")
        return "synthetic: uniform random token ids, labels = inputs (shifted by the model); one fixed batch per case"

    @property
    def is_moe(self) -> bool:
        return self.family in MOE_FAMILIES

    def model_config(self, overrides: dict | None = None):
        """The preset's config with the suite's ``model_options`` and then ``overrides`` (an arm's
        own settings, such as ``chain_layer_norms=False`` for FSDP2) set on it, validated."""
        import importlib

        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; choose one of {', '.join(FAMILIES)}")
        module = importlib.import_module(PRESET_MODULES[self.family])
        factory = getattr(module, self.preset, None) if not self.preset.startswith("_") else None
        if not callable(factory):
            raise ValueError(f"unknown {self.family} preset {self.preset!r} (presets live in {module.__name__})")
        config = factory()
        for key, value in {**self.model_options, **(overrides or {})}.items():
            if not hasattr(config, key):
                raise ValueError(f"model option {key!r} is not a field of {type(config).__name__}")
            setattr(config, key, value)
        config.validate()
        return config

    def build_model(self, kernels: str, device: torch.device | str | None = None,
                    overrides: dict | None = None) -> nn.Module:
        """Our model with ``kernels``, its weights initialised directly on ``device`` from the
        suite's seed (so the dslab and torch arms start from the same weights); ``overrides``
        as for :meth:`model_config` (settings that leave the weights as they are)."""
        from dslab.bench.evoformer import EvoformerTrainModel
        from dslab.bench.moe_layer import MoELayerModel
        from dslab.models.bert import BertForPreTraining
        from dslab.models.gpt2 import GPT2LMHeadModel
        from dslab.models.gpt2_moe import GPT2MoELMHeadModel
        from dslab.models.llama import LlamaForCausalLM

        cls = {"bert": BertForPreTraining, "gpt2": GPT2LMHeadModel, "gpt2_moe": GPT2MoELMHeadModel,
               "moe_layer": MoELayerModel, "evoformer": EvoformerTrainModel, "llama": LlamaForCausalLM}[self.family]
        config = self.model_config(overrides)
        torch.manual_seed(self.seed)
        with torch.device(device or "cpu"):
            return cls(config, kernels=kernels)

    def build_hf_model(self, device: torch.device | str | None = None) -> nn.Module:
        """transformers' own model of the same shape (random init on ``device``), SDPA attention;
        for the MoE families, transformers' Mixtral sparse-MoE block (:mod:`dslab.bench.hf_moe`)."""
        import transformers

        if self.family not in ARM_FAMILIES["hf"][0]:
            raise ValueError(f"family {self.family!r} has no transformers model: {ARM_FAMILIES['hf'][1]}")
        cfg = self.model_config()
        torch.manual_seed(self.seed)
        if self.is_moe:
            from dslab.bench import hf_moe

            with torch.device(device or "cpu"):
                return hf_moe.HFGPT2MoE(cfg) if self.family == "gpt2_moe" else hf_moe.HFMoELayer(cfg)
        if self.family == "llama":
            hf_cfg = transformers.LlamaConfig(**cfg.hf_kwargs(), attn_implementation="sdpa")
            with torch.device(device or "cpu"):
                return transformers.LlamaForCausalLM(hf_cfg)
        if self.family == "bert":
            hf_cfg = transformers.BertConfig(
                vocab_size=cfg.vocab_size, hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
                num_attention_heads=cfg.heads, intermediate_size=cfg.intermediate,
                max_position_embeddings=cfg.max_position, type_vocab_size=cfg.type_vocab,
                hidden_dropout_prob=cfg.hidden_dropout, attention_probs_dropout_prob=cfg.attention_dropout,
                layer_norm_eps=cfg.layer_norm_eps, attn_implementation="sdpa",
            )
            with torch.device(device or "cpu"):
                return transformers.BertForPreTraining(hf_cfg)
        hf_cfg = transformers.GPT2Config(
            vocab_size=cfg.vocab_size, n_positions=cfg.n_positions, n_embd=cfg.hidden, n_layer=cfg.layers,
            n_head=cfg.heads, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
            layer_norm_epsilon=cfg.layer_norm_epsilon, attn_implementation="sdpa",
        )
        with torch.device(device or "cpu"):
            return transformers.GPT2LMHeadModel(hf_cfg)

    def make_batch(self, device: torch.device) -> dict[str, torch.Tensor]:
        cfg = self.model_config()
        b, s = self.case.micro_batch, self.case.seq_len
        if self.family == "evoformer":
            from dslab.bench.evoformer import evoformer_batch

            return evoformer_batch(cfg, b, HALF_DTYPES.get(self.precision, torch.float32), self.seed, device)
        g = torch.Generator(device=device).manual_seed(self.seed)
        if self.family == "moe_layer":
            dtype = HALF_DTYPES.get(self.precision, torch.float32)
            return {"hidden_states": torch.randn(b, s, cfg.hidden, generator=g, device=device).to(dtype)}
        ids = torch.randint(0, cfg.vocab_size, (b, s), generator=g, device=device)
        if self.family in LANGUAGE_MODELS:
            return {"input_ids": ids, "labels": ids.clone()}
        token_type = torch.zeros(b, s, dtype=torch.long, device=device)
        token_type[:, s // 2:] = 1
        masked = torch.rand(b, s, generator=g, device=device) < MLM_PROBABILITY
        masked[:, 0] = False  # never the [CLS] position
        labels = torch.where(masked, ids, torch.full_like(ids, -100))
        roll = torch.rand(b, s, generator=g, device=device)
        inputs = ids.clone()
        inputs[masked & (roll < 0.8)] = MASK_TOKEN_ID
        random_tokens = torch.randint(0, cfg.vocab_size, (b, s), generator=g, device=device)
        swap = masked & (roll >= 0.8) & (roll < 0.9)
        inputs[swap] = random_tokens[swap]
        nsp = torch.randint(0, 2, (b,), generator=g, device=device)
        return {"input_ids": inputs, "token_type_ids": token_type, "masked_lm_labels": labels,
                "next_sentence_label": nsp}

    def loss_fn(self, hf: bool = False) -> Callable[[nn.Module, dict], torch.Tensor]:
        """``fn(model, batch) -> scalar loss`` for our models or (``hf=True``) transformers'."""
        if not hf or self.is_moe:  # the MoE families' hf models return their loss themselves
            return lambda model, batch: model(**batch)
        if self.family == "bert":
            return lambda model, batch: model(
                input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                labels=batch["masked_lm_labels"], next_sentence_label=batch["next_sentence_label"],
            ).loss
        return lambda model, batch: model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    def samples_and_tokens(self) -> tuple[int, int]:
        """Samples and tokens of one micro-batch: sequences and their tokens; for the Evoformer,
        crops and their ``n_seq * n_res`` MSA positions."""
        if self.family == "evoformer":
            cfg = self.model_config()
            return self.case.micro_batch, self.case.micro_batch * cfg.n_seq * cfg.n_res
        return self.case.micro_batch, self.case.micro_batch * self.case.seq_len

    def formula_forward_flops(self) -> int | None:
        """Matmul and attention flops of one forward of the micro-batch by the model's own formula
        (:func:`dslab.models.evoformer.evoformer_flops`), for the families that have one; None for
        the others. The runner's counted flops (forward and backward) are what TFLOP/s divides."""
        if self.family != "evoformer":
            return None
        from dslab.models.evoformer import evoformer_flops

        return evoformer_flops(self.model_config(), batch=self.case.micro_batch)

    def moe_layer_count(self) -> int:
        cfg = self.model_config()
        return len(cfg.moe_layers) if self.family == "gpt2_moe" else 1

    def expert_flops_per_step(self, kept_assignments: list[int] | None = None, hf: bool = False) -> int | None:
        """Forward + backward flops of the experts in one step, over every MoE layer: each kept
        (token, expert) assignment costs two ``hidden x ffn`` matmuls forward (4 * H * F flops)
        and twice that backward, 12 * H * F in all (the hf arm's gated experts: three matrices,
        :func:`dslab.bench.hf_moe.expert_flops`). ``kept_assignments`` per MoE layer (the dslab
        arm's counts); without them, tokens * k per layer when the layers are dropless, else None."""
        if not self.is_moe:
            return None
        cfg = self.model_config()
        hidden = cfg.hidden
        ffn = cfg.intermediate if self.family == "gpt2_moe" else cfg.ffn
        tokens = self.samples_and_tokens()[1]
        if hf:  # transformers' Mixtral block is dropless
            from dslab.bench.hf_moe import expert_flops

            return self.moe_layer_count() * expert_flops(tokens * cfg.k, hidden)
        if kept_assignments is None:
            if cfg.drop_tokens:
                return None
            kept_assignments = [tokens * cfg.k] * self.moe_layer_count()
        return sum(12 * kept * hidden * ffn for kept in kept_assignments)


def workloads_for(suite: SuiteConfig, scale: str, cases: list[str] | None = None) -> list[Workload]:
    """The workloads of ``scale``'s cases (``cases`` or all), each config checked (a ValueError
    naming the case and the problem)."""
    if scale not in suite.scales:
        raise ValueError(f"suite {suite.name} has no scale {scale!r}; it has {', '.join(suite.scales)}")
    sc = suite.scales[scale]
    workloads = [
        Workload(
            family=case.family or suite.family,
            preset=case.preset or sc.preset,
            case=case,
            model_options={**suite.model_options, **case.model_options},
            seed=suite.seed,
            precision=suite.precision,
        )
        for case in select_cases(sc, cases)
    ]
    for w in workloads:
        try:
            w.model_config()
        except ValueError as err:
            raise ValueError(f"suite {suite.name}, scale {scale}, case {w.case.name!r}: {err}") from None
    return workloads
