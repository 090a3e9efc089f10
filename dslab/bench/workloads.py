"""What each model family trains on in a benchmark: the model, a synthetic batch made on the
device, and the loss call; plus the matching HuggingFace model for the ``hf`` arm.

Data is synthetic and fixed per case (one batch, reused every step), drawn from a seeded
generator on the device:

- BERT: random token ids, two segments (token type 0 then 1), no padding; 15% of positions are
  masked for MLM (of those, 80% replaced by [MASK], 10% by a random token, 10% kept) with labels
  at the masked positions only; NSP labels are random.
- GPT-2: random token ids; labels are the inputs (the model shifts them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from dslab.bench.suite import CaseConfig, SuiteConfig, select_cases

MASK_TOKEN_ID = 103
MLM_PROBABILITY = 0.15


@dataclass
class Workload:
    """One case of a suite, ready to build models and batches for."""

    family: str
    preset: str
    case: CaseConfig
    model_options: dict
    seed: int

    @property
    def data_description(self) -> str:
        if self.family == "bert":
            return ("synthetic: uniform random token ids, 2 segments, no padding, 15% MLM masking "
                    "(80/10/10), random NSP labels; one fixed batch per case made on the device")
        return "synthetic: uniform random token ids, labels = inputs (shifted by the model); one fixed batch per case"

    def model_config(self):
        from dslab.models import bert, gpt2

        module = bert if self.family == "bert" else gpt2
        factory = getattr(module, self.preset, None)
        if factory is None:
            raise ValueError(f"unknown {self.family} preset {self.preset!r}")
        config = factory()
        for key, value in self.model_options.items():
            if not hasattr(config, key):
                raise ValueError(f"model option {key!r} is not a field of {type(config).__name__}")
            setattr(config, key, value)
        return config

    def build_model(self, kernels: str, device: torch.device | str | None = None) -> nn.Module:
        """Our model with ``kernels``, its weights initialised directly on ``device`` from the
        suite's seed (so the dslab and torch arms start from the same weights)."""
        from dslab.models.bert import BertForPreTraining
        from dslab.models.gpt2 import GPT2LMHeadModel

        torch.manual_seed(self.seed)
        cls = BertForPreTraining if self.family == "bert" else GPT2LMHeadModel
        with torch.device(device or "cpu"):
            return cls(self.model_config(), kernels=kernels)

    def build_hf_model(self, device: torch.device | str | None = None) -> nn.Module:
        """transformers' own model of the same shape (random init on ``device``), SDPA attention."""
        import transformers

        cfg = self.model_config()
        torch.manual_seed(self.seed)
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
        g = torch.Generator(device=device).manual_seed(self.seed)
        ids = torch.randint(0, cfg.vocab_size, (b, s), generator=g, device=device)
        if self.family == "gpt2":
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
        if not hf:
            return lambda model, batch: model(**batch)
        if self.family == "bert":
            return lambda model, batch: model(
                input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                labels=batch["masked_lm_labels"], next_sentence_label=batch["next_sentence_label"],
            ).loss
        return lambda model, batch: model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    def samples_and_tokens(self) -> tuple[int, int]:
        return self.case.micro_batch, self.case.micro_batch * self.case.seq_len


def workloads_for(suite: SuiteConfig, scale: str, cases: list[str] | None = None) -> list[Workload]:
    if scale not in suite.scales:
        raise ValueError(f"suite {suite.name} has no scale {scale!r}; it has {', '.join(suite.scales)}")
    sc = suite.scales[scale]
    return [
        Workload(
            family=suite.family,
            preset=case.preset or sc.preset,
            case=case,
            model_options={**suite.model_options, **case.model_options},
            seed=suite.seed,
        )
        for case in select_cases(sc, cases)
    ]
