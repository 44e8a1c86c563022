"""Flax NNX models: GPT-2 (teacher and sparse students), the CANDS cascade, and the layers they
are built from."""

from sparse_jax.models.cascade import CascadeConfig, CascadeLM, PrunedCascadeLM
from sparse_jax.models.gpt2 import (
    GPT2,
    AttentionSpec,
    GPT2Config,
    generate,
    student_from_teacher,
)
from sparse_jax.models.hardening import HardenReport, harden, harden_plan
from sparse_jax.models.hf import from_pretrained, save_pretrained
from sparse_jax.models.layers import CandidateMaskAttention, FixedAttention, Gate

__all__ = [
    "GPT2",
    "AttentionSpec",
    "CandidateMaskAttention",
    "CascadeConfig",
    "CascadeLM",
    "FixedAttention",
    "GPT2Config",
    "Gate",
    "HardenReport",
    "PrunedCascadeLM",
    "from_pretrained",
    "generate",
    "harden",
    "harden_plan",
    "save_pretrained",
    "student_from_teacher",
]
