"""Sparse normalizers (sparsemax, 1.5-entmax, α-entmax) and their Fenchel–Young losses.

α-entmax maps scores ``x`` to the probability vector

    p_i = [(α - 1) x_i - τ]_+ ^ (1 / (α - 1)),      with τ chosen so that Σ_i p_i = 1.

α → 1 recovers softmax, α = 2 is sparsemax (Martins & Astudillo, 2016) and α = 1.5 is 1.5-entmax
(Peters, Niculae & Martins, 2019); every α > 1 gives exact zeros, and α = 1 is softmax itself.
"Adaptively Sparse Transformers" (Correia et al., 2019) learn one α per attention head, so
``entmax`` differentiates in α too.

How the threshold τ is found (the part that decides speed)
-----------------------------------------------------------
The textbook algorithm sorts every row. On XLA:CPU a row sort costs many times the rest of
attention (docs/benchmarks.md, "Normalizers", against optax's sort-based projection), so
nothing here sorts. Every row is shifted so that its maximum is 0; then τ ∈ [-1, -(1/n)^(α-1)]
and f(τ) = Σ_i [z_i - τ]_+^(1/(α-1)) - 1 is decreasing. Each iteration is *one* pass over the
row that gathers a few sums over the current support S(τ) = {i : z_i > τ} in fused variadic
reductions; all rows iterate together until the last one is finished. On CPU each row is summed
in two stages, as a short column of vectors and then across them, which XLA:CPU vectorises
(``search.row_sums``; docs/archive/benchmarks-history.md, "Two-stage row sums on CPU").

* ``sparsemax``: Michelot's fixed point τ ← (Σ_S z - 1) / |S| from τ = -1, which is Newton's
  method on the piecewise linear f started left of the root. The iterates increase, the
  support shrinks strictly until it is the true support, and an unchanged support size ends
  the row: τ is then the closed-form threshold of its own support, i.e. exact. At most n
  passes; on attention scores 3-7.
* ``entmax15``: Newton steps on ||[z - τ]_+||_2 - 1 from τ = -1 (convex and nearly linear, so
  the iterates rise monotonically and fast). Each pass also forms the exact root τ_c of
  Σ_S (z - τ)² = 1 on the current support and the next pass checks that the entries >= τ_c
  cover S (the KKT conditions); a final pass recomputes the same closed form from sums centred
  on τ_c, which makes it exact to float rounding.
* general α (``entmax`` with any other α, or an array of α): Newton on
  ||[z - τ]_+||_(1/(α-1)) - 1, safeguarded by a bisection bracket (a step that leaves the
  bracket, or fails to halve the previous step, is replaced by bisection; this matters for
  α > 2), until the step is at rounding level; the output is divided by its sum. For α - 1 <=
  0.05 the threshold is held as σ = 1 + τ (τ is then near -1, where a float keeps too few of
  its digits for p = u^(1/(α-1))), which keeps values, derivatives and losses accurate to
  float32 rounding for every α > 1 down to 1 + 1e-7, approaching softmax continuously
  (tests/test_reliability_normalizers.py checks them against a float64 reference).

The iterations never enter the derivative: custom rules use the closed form
``dp = s ⊙ dx - s (sᵀdx) / Σs`` with s_i = p_i^(2-α) on the support (a symmetric Jacobian, so
the same product serves forward and reverse mode), which is linear in the row length, and the
α derivative of Correia et al. (2019), rewritten without a division by α - 1 in
``alpha_entmax._entmax_dp_dalpha``. ``sparsemax``, ``entmax15`` and ``entmax`` have custom
VJPs (reverse mode only: ``jax.grad``, ``jax.vjp``, ``jax.jacrev``;
``jax.jvp``/``jacfwd``/``hessian`` raise), whose only residual is the output: see the comment
above ``exact._entmax15_s``.

Conventions shared by every function here: the row is ``axis`` (default last); positions where
``where`` is False, or whose score is ``-inf``, get probability exactly 0; a row with no allowed
position returns zeros and a zero gradient (never NaN); float16/bfloat16 inputs are computed in
float32 and returned in their own dtype.

Non-finite scores, one policy for every normalizer (``masked_softmax``/``normalize`` included)
and, through them, both attention engines:

* NaN at an allowed position: the whole row is NaN (NaN in, NaN out: never a silent zero or a
  partly NaN row), and so are the row's derivatives.
* Values at masked positions (``where`` False) never matter, NaN and ±inf included.
* ``-inf``: masked (probability exactly 0).
* ``+inf`` at an allowed position: the row's weight goes uniformly to its ``+inf`` entries
  (the limit of raising them together); the others get 0, the values and gradients are finite.
  (Scores equal to the largest finite float count as ``+inf``.)
* ``alpha``: α > 1 is α-entmax and α = 1 exactly is softmax; α < 1, NaN and ±inf raise a
  ``ValueError`` naming it when concrete, and make their rows NaN when traced (the same rule
  in every attention engine; with :func:`enable_traced_checks`, ``jax.experimental.checkify``
  turns it into an error under ``jit``: see :func:`entmax`). The losses are NaN for a NaN
  logit in a row that is not padding.

Arguments are checked before anything is traced: a wrong type, an empty normalized axis, a bad
``axis`` (python or numpy integers, 0-d integer arrays), ``where`` or ``alpha`` raise
``TypeError``/``ValueError`` naming the argument.

The package, imported one way (each module imports only those listed before it):
:mod:`~sparse_jax.normalizers.arguments` (argument checks and layout),
:mod:`~sparse_jax.normalizers.search` (the row-threshold search the normalizers share, the
non-finite policy and the closed-form Jacobian), :mod:`~sparse_jax.normalizers.exact`
(sparsemax and 1.5-entmax), :mod:`~sparse_jax.normalizers.alpha_entmax` (α-entmax),
:mod:`~sparse_jax.normalizers.losses` (the Fenchel–Young losses),
:mod:`~sparse_jax.normalizers.softmax` (masked softmax) and
:mod:`~sparse_jax.normalizers.named` (a normalizer by name or α, what the engines call).
"""

from sparse_jax.normalizers.alpha_entmax import LIFT_FROM_EPS as LIFT_FROM_EPS
from sparse_jax.normalizers.alpha_entmax import SIGMA_MAX_EPS as SIGMA_MAX_EPS
from sparse_jax.normalizers.alpha_entmax import entmax
from sparse_jax.normalizers.alpha_entmax import entmax_alpha_terms as entmax_alpha_terms
from sparse_jax.normalizers.alpha_entmax import entmax_powers as entmax_powers
from sparse_jax.normalizers.alpha_entmax import entmax_search as entmax_search
from sparse_jax.normalizers.alpha_entmax import expm1_from_exp as expm1_from_exp
from sparse_jax.normalizers.arguments import alpha_eps as alpha_eps
from sparse_jax.normalizers.arguments import bad_alpha as bad_alpha
from sparse_jax.normalizers.arguments import enable_traced_checks
from sparse_jax.normalizers.exact import POLISH_FREE_EXCESS as POLISH_FREE_EXCESS
from sparse_jax.normalizers.exact import entmax15, sparsemax
from sparse_jax.normalizers.exact import entmax15_polish as entmax15_polish
from sparse_jax.normalizers.exact import entmax15_polish_terms as entmax15_polish_terms
from sparse_jax.normalizers.exact import entmax15_search as entmax15_search
from sparse_jax.normalizers.exact import entmax15_start as entmax15_start
from sparse_jax.normalizers.exact import sparsemax_search as sparsemax_search
from sparse_jax.normalizers.exact import sparsemax_start as sparsemax_start
from sparse_jax.normalizers.losses import entmax15_loss, entmax_loss, sparsemax_loss
from sparse_jax.normalizers.named import NORMALIZERS, normalize
from sparse_jax.normalizers.search import RowSearch as RowSearch
from sparse_jax.normalizers.softmax import masked_softmax

# The API. The names imported `as` themselves are the searches and constants the fused kernels
# share (sparse_jax.kernels, experiments.bench), kept here under the names they had, and the α
# rule the engines share (sparse_jax.validation, sparse_jax.kernels).
__all__ = [
    "NORMALIZERS",
    "enable_traced_checks",
    "entmax",
    "entmax15",
    "entmax15_loss",
    "entmax_loss",
    "masked_softmax",
    "normalize",
    "sparsemax",
    "sparsemax_loss",
]
