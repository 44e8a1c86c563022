"""Hugging Face GPT-2 checkpoints (``config.json`` + ``model.safetensors``) in and out.

Only safetensors files are read: a pickled ``pytorch_model.bin`` can execute code when it is
loaded, so it is refused with a message that says how to convert it. The tensor names are
those of ``GPT2LMHeadModel`` (``transformer.h.0.attn.c_attn.weight`` ...; the ``transformer.``
prefix is optional, the LM head is tied to ``wte`` and not stored, ``attn.bias`` buffers of
older checkpoints are ignored). HF's ``Conv1D`` stores ``[in, out]`` matrices, the layout of
``nnx.Linear`` kernels, so weights are copied without transposition.

Loading and saving live here only (:mod:`sparse_jax.models.gpt2` does not import this module).

Example (a round trip through a folder):
  >>> import tempfile
  >>> from flax import nnx
  >>> from sparse_jax.models.gpt2 import GPT2, GPT2Config
  >>> model = GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(0))
  >>> folder = save_pretrained(model, tempfile.mkdtemp() + "/gpt2-copy")
  >>> from_pretrained(folder).config == model.config
  True
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
from typing import Any

import numpy as np
from flax import nnx

from sparse_jax.files import remove_dead_leftovers, sibling
from sparse_jax.models.gpt2 import GPT2, AttentionSpec, GPT2Config

__all__ = [
    "PretrainedFileError",
    "check_weights_file",
    "config_from_hf",
    "from_pretrained",
    "read_config",
    "save_pretrained",
]

_PICKLES = ("pytorch_model.bin", "tf_model.h5", "flax_model.msgpack", "model.ckpt.index")
_LN = {"weight": "scale", "bias": "bias"}
_REQUIRED = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
# What to do about a damaged file of a folder given by the user (a caller may say better).
_ADVICE = "Download the folder again (or write it again with save_pretrained), or pass another one."


class PretrainedFileError(ValueError):
    """``config.json`` or ``model.safetensors`` of a folder cannot be used; ``path`` is the file.

    The message names the file, what is wrong and what to do.
    """

    def __init__(self, path: str | os.PathLike, problem: str, advice: str = _ADVICE):
        self.path = pathlib.Path(path)
        self.problem = problem
        super().__init__(f"from_pretrained: {self.path}: {problem}. {advice}")


def config_from_hf(hf: dict[str, Any], **overrides: Any) -> GPT2Config:
    """A :class:`~sparse_jax.models.gpt2.GPT2Config` from a Hugging Face ``config.json`` dict.

    Raises ``TypeError`` when ``hf`` is not a dict and ``ValueError`` naming what is wrong: a
    missing key, another ``model_type``, an unsupported option or a value GPT2Config refuses.

    Example:
      >>> hf = {"vocab_size": 101, "n_positions": 37, "n_embd": 48, "n_layer": 2, "n_head": 3}
      >>> config_from_hf(hf) == GPT2Config.preset("tiny")
      True
      >>> config_from_hf(hf, n_positions=64).n_positions  # overrides win
      64
      >>> config_from_hf({**hf, "model_type": "bert"})
      Traceback (most recent call last):
      ...
      ValueError: config.json: model_type 'bert' is not 'gpt2'
    """
    if not isinstance(hf, dict):
        raise TypeError(
            f"config.json must hold a JSON object (a dict of GPT-2 settings); got "
            f"{type(hf).__name__}"
        )
    missing = [key for key in _REQUIRED if key not in hf]
    if missing:
        raise ValueError(
            f"config.json lacks the keys {missing} (a GPT-2 config.json has {list(_REQUIRED)})"
        )
    if hf.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"config.json: model_type {hf.get('model_type')!r} is not 'gpt2'")
    unsupported = [
        key
        for key, ok in (
            ("scale_attn_by_inverse_layer_idx", False),
            ("reorder_and_upcast_attn", False),
            ("add_cross_attention", False),
            ("scale_attn_weights", True),
        )
        if hf.get(key, ok) != ok
    ]
    if unsupported:
        raise ValueError(f"config.json: unsupported GPT-2 options {unsupported} (not implemented)")
    fields = {
        "vocab_size": hf["vocab_size"],
        "n_positions": hf["n_positions"],
        "n_embd": hf["n_embd"],
        "n_layer": hf["n_layer"],
        "n_head": hf["n_head"],
        "n_inner": hf.get("n_inner"),
        "layer_norm_epsilon": hf.get("layer_norm_epsilon", 1e-5),
        "activation_function": hf.get("activation_function", "gelu_new"),
        "smear_keys": hf.get("smear_keys", False),
        "smear_width": hf.get("smear_width", 1),
        "positions": hf.get("positions", "learned"),
    }
    return GPT2Config(**{**fields, **overrides})


def _resolve(source: str | os.PathLike) -> pathlib.Path:
    path = pathlib.Path(source)
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(
            f"from_pretrained: `path_or_name`={str(source)!r} is a file; pass its folder"
        )
    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", str(source)) or str(source).startswith("."):
        raise FileNotFoundError(f"from_pretrained: folder {str(source)!r} does not exist")
    offline = any(os.environ.get(v) == "1" for v in ("HF_HUB_OFFLINE", "SPARSE_JAX_OFFLINE"))
    try:
        import huggingface_hub
    except ImportError:
        huggingface_hub = None
    if huggingface_hub is None or offline:
        why = "offline mode is set" if offline else "huggingface_hub is not installed"
        raise FileNotFoundError(
            f"from_pretrained: {str(source)!r} is not a local folder and cannot be fetched from "
            f"the Hugging Face hub ({why}). Download `config.json` and `model.safetensors` of "
            f"the hub repository {str(source)!r} on a machine with network into a folder and "
            "pass that folder."
        )
    folder = huggingface_hub.snapshot_download(
        str(source), allow_patterns=["config.json", "model.safetensors"]
    )
    return pathlib.Path(folder)


def from_pretrained(
    path_or_name: str | os.PathLike,
    attention: AttentionSpec | Any = None,
    *,
    rngs: nnx.Rngs | None = None,
) -> GPT2:
    """Builds a :class:`~sparse_jax.models.gpt2.GPT2` with the weights of a Hugging Face GPT-2.

    Args:
      path_or_name: a folder with ``config.json`` and ``model.safetensors``, or a hub
        repository name (fetched with ``huggingface_hub`` when a network is available).
      attention: an :class:`~sparse_jax.models.gpt2.AttentionSpec` or one per block
        (default: causal softmax, the teacher).
      rngs: for parameters the checkpoint does not hold (gates, candidate weights).

    Raises:
      FileNotFoundError: missing folder or files (the message lists them).
      PretrainedFileError: (a ``ValueError``) ``config.json`` is not valid JSON, lacks a key
        or holds a value of the wrong type; ``model.safetensors`` is empty, truncated, not a
        safetensors file, or holds tensors that do not fit ``config.json``, or a tensor holds
        NaN/inf or implausibly large entries (bytes overwritten). The message names the file,
        the tensor, what is wrong and what to do.
      ValueError: a pickled checkpoint only (refused).

    Example (a round trip through a folder: see :func:`save_pretrained`):
      >>> from_pretrained("/no/such/folder")
      Traceback (most recent call last):
      ...
      FileNotFoundError: from_pretrained: folder '/no/such/folder' does not exist
    """
    folder = _resolve(path_or_name)
    weights_file, config_file = folder / "model.safetensors", folder / "config.json"
    if not weights_file.exists():
        pickles = [p for p in _PICKLES if (folder / p).exists()]
        if pickles:
            raise ValueError(
                f"from_pretrained: {folder} holds only {pickles}: pickled checkpoints can run "
                "arbitrary code when loaded, so they are refused. Convert once, in an "
                "environment you trust, with transformers: `GPT2LMHeadModel.from_pretrained("
                f"'{folder}').save_pretrained('<new folder>')` (writes model.safetensors)."
            )
        missing = [f.name for f in (config_file, weights_file) if not f.exists()]
        raise FileNotFoundError(f"from_pretrained: {folder} lacks {missing}")
    if not config_file.exists():
        raise FileNotFoundError(f"from_pretrained: {folder} lacks ['config.json']")
    config = read_config(config_file)
    tensors = {k.removeprefix("transformer."): v for k, v in _read_weights(weights_file).items()}
    model = GPT2(
        config, AttentionSpec() if attention is None else attention, rngs=rngs or nnx.Rngs(0)
    )
    _assign(model, tensors, folder)
    return model


def read_config(config_file: str | os.PathLike) -> GPT2Config:
    """The GPT2Config of a Hugging Face ``config.json``; :class:`PretrainedFileError` (naming the
    file) when it cannot be read, is not JSON, or does not describe a GPT-2 this package runs.

    Example:
      >>> import tempfile
      >>> tmp = tempfile.TemporaryDirectory()
      >>> path = pathlib.Path(tmp.name) / "config.json"
      >>> hf = {"vocab_size": 101, "n_positions": 37, "n_embd": 48, "n_layer": 2, "n_head": 3}
      >>> _ = path.write_text(json.dumps(hf))
      >>> read_config(path) == GPT2Config.preset("tiny")
      True
      >>> _ = path.write_text("{")
      >>> read_config(path)
      Traceback (most recent call last):
      ...
      sparse_jax.models.hf.PretrainedFileError: from_pretrained: ...config.json: is not valid ...
      >>> tmp.cleanup()
    """
    config_file = pathlib.Path(config_file)
    try:
        text = config_file.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise PretrainedFileError(config_file, f"cannot be read ({err})") from err
    try:
        hf = json.loads(text)
    except json.JSONDecodeError as err:
        what = "is empty" if not text.strip() else f"is not valid JSON ({err})"
        raise PretrainedFileError(config_file, what) from err
    try:
        return config_from_hf(hf)
    except (TypeError, ValueError) as err:
        problem = str(err).removeprefix("config.json: ").removeprefix("config.json ")
        problem = problem.removeprefix("GPT2Config: ")
        raise PretrainedFileError(config_file, problem) from err


def check_weights_file(weights_file: str | os.PathLike) -> None:
    """Reads the header of a ``model.safetensors`` (not its tensors):
    :class:`PretrainedFileError` when the file is empty, truncated or not safetensors.

    Example:
      >>> import tempfile
      >>> from safetensors.numpy import save_file
      >>> tmp = tempfile.TemporaryDirectory()
      >>> good = pathlib.Path(tmp.name) / "model.safetensors"
      >>> save_file({"wte.weight": np.zeros((5, 4), np.float32)}, str(good))  # [V, D]
      >>> check_weights_file(good)  # a readable header: returns None
      >>> empty = pathlib.Path(tmp.name) / "empty.safetensors"
      >>> _ = empty.write_bytes(b"")
      >>> check_weights_file(empty)
      Traceback (most recent call last):
      ...
      sparse_jax.models.hf.PretrainedFileError: from_pretrained: .../empty.safetensors: is empty ...
      >>> tmp.cleanup()
    """
    from safetensors import SafetensorError, safe_open

    weights_file = pathlib.Path(weights_file)
    try:
        with safe_open(weights_file, framework="numpy") as f:
            f.keys()
    except (SafetensorError, OSError, ValueError) as err:
        raise _weights_error(weights_file, err) from err


def _weights_error(weights_file: pathlib.Path, err: Exception) -> PretrainedFileError:
    size = weights_file.stat().st_size if weights_file.exists() else 0
    what = "is empty (0 bytes)" if size == 0 else f"cannot be read as safetensors ({err})"
    return PretrainedFileError(
        weights_file, f"{what}: the file is truncated, damaged or of another format"
    )


def _read_weights(weights_file: pathlib.Path) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        return load_file(weights_file)
    except (SafetensorError, OSError, ValueError) as err:
        raise _weights_error(weights_file, err) from err
    except (TypeError, AttributeError) as err:  # a dtype numpy lacks: bfloat16, float8 ...
        raise PretrainedFileError(
            weights_file,
            f"holds tensors of a data type that cannot be read here ({err})",
            "Save the weights as float32 or float16 (save_pretrained writes either).",
        ) from err


def _expected(config) -> dict[str, tuple[int, ...]]:
    d, v, p = config.n_embd, config.vocab_size, config.n_positions
    shapes = {"wte.weight": (v, d), "wpe.weight": (p, d), "ln_f.weight": (d,), "ln_f.bias": (d,)}
    if config.positions == "rotary":  # no table: the attentions turn queries and keys
        del shapes["wpe.weight"]
    for i in range(config.n_layer):
        n, u = config.heads(i) * config.head_dim, config.inner(i)
        pre = f"h.{i}."
        shapes |= {
            pre + "ln_1.weight": (d,),
            pre + "ln_1.bias": (d,),
            pre + "ln_2.weight": (d,),
            pre + "ln_2.bias": (d,),
            pre + "attn.c_attn.weight": (d, 3 * n),
            pre + "attn.c_attn.bias": (3 * n,),
            pre + "attn.c_proj.weight": (n, d),
            pre + "attn.c_proj.bias": (d,),
            pre + "mlp.c_fc.weight": (d, u),
            pre + "mlp.c_fc.bias": (u,),
            pre + "mlp.c_proj.weight": (u, d),
            pre + "mlp.c_proj.bias": (d,),
        }
        if config.smear_keys and n:
            width = config.smear_width
            heads = config.heads(i)
            shapes[pre + "attn.smear_logit"] = (heads,) if width == 1 else (heads, width)
    return shapes


def _variable(model, name: str):
    """The nnx variable of a Hugging Face tensor name."""
    parts = name.split(".")
    if parts[0] in ("wte", "wpe"):
        return getattr(model, parts[0]).embedding
    if parts[0] == "ln_f":
        return getattr(model.ln_f, _LN[parts[1]])
    block = model.h[int(parts[1])]
    if parts[2] in ("ln_1", "ln_2"):
        return getattr(getattr(block, parts[2]), _LN[parts[3]])
    if parts[3] == "smear_logit":
        return block.attn.smear_logit
    layer = getattr(getattr(block, parts[2]), parts[3])  # attn.c_attn, mlp.c_fc, ...
    return layer.kernel if parts[4] == "weight" else layer.bias


def _assign(model, tensors: dict[str, np.ndarray], folder) -> None:
    expected = _expected(model.config)
    ignored = {k for k in tensors if k.endswith((".attn.bias", ".attn.masked_bias"))}
    head = tensors.pop("lm_head.weight", None)
    if head is not None and not np.array_equal(head, tensors.get("wte.weight")):
        raise ValueError(f"from_pretrained: {folder}: an untied lm_head.weight is not supported")
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected) - ignored)
    weights_file = pathlib.Path(folder) / "model.safetensors"
    if missing or extra:
        raise PretrainedFileError(
            weights_file,
            f"does not hold the GPT-2 tensors that config.json describes: missing "
            f"{missing[:8]}{'...' if len(missing) > 8 else ''}, unexpected {extra[:8]}",
            "Pass a folder of a GPT-2 (GPT2LMHeadModel) checkpoint whose config.json and "
            "model.safetensors belong together.",
        )
    for name, shape in expected.items():
        value = tensors[name]
        if tuple(value.shape) != shape:
            raise PretrainedFileError(
                weights_file,
                f"tensor {name!r} has shape {tuple(value.shape)}; config.json needs {shape}",
                "Pass a folder whose config.json and model.safetensors belong together.",
            )
        value = np.asarray(value, np.float32)
        _check_values(weights_file, name, value)
        _variable(model, name)[...] = value


# No trained GPT-2 weight comes near this; bytes overwritten by junk decode to far larger
# numbers (or NaN/inf) almost always.
_MAX_WEIGHT = 1e6


def _check_values(weights_file: pathlib.Path, name: str, value: np.ndarray) -> None:
    """Refuses a tensor holding NaN/inf or entries beyond ``_MAX_WEIGHT`` (one pass)."""
    largest = float(np.max(np.abs(value))) if value.size else 0.0
    if largest <= _MAX_WEIGHT:  # False for NaN too
        return
    if np.isfinite(largest):
        what = f"entries as large as {largest:.3g} (beyond {_MAX_WEIGHT:g}, no trained weight's)"
    else:
        bad = int(np.count_nonzero(~np.isfinite(value)))
        what = f"{bad} NaN or infinite entries of {value.size}"
    raise PretrainedFileError(weights_file, f"tensor {name!r} holds {what}: the file is damaged")


def save_pretrained(
    model: GPT2, path: str | os.PathLike, *, dtype: str = "float32"
) -> pathlib.Path:
    """Writes ``model`` as a Hugging Face GPT-2 folder ``path`` (``config.json``,
    ``model.safetensors``); returns the folder.

    ``dtype`` is the tensors' type in the file: ``"float32"`` (exact) or ``"float16"`` (half the
    size, each weight rounded; :func:`from_pretrained` reads either back as float32).

    A new folder is written under a temporary name beside it and renamed into place when
    complete, so a save killed midway never leaves a folder that looks saved (only a hidden
    ``.<name>.partial-*`` folder, removed by a later save of the same folder). An existing
    folder gets each file replaced atomically, the weights first.

    Only the dense architecture is expressible there: models with pruned heads or FFN units, or
    with parameters beyond GPT-2's (gates, candidate weights, learned α), are refused (save
    them with the training checkpoints instead). The attention spec is not stored: loading gives
    the dense causal softmax model unless another spec is passed. A model with smeared keys
    (``GPT2Config.smear_keys``) is written with ``"smear_keys": true`` in ``config.json`` and a
    tensor ``h.<i>.attn.smear_logit`` ``[N]`` per block: :func:`from_pretrained` reads it back,
    but Hugging Face's own ``GPT2LMHeadModel`` does not know smeared keys and would compute
    another function from those files. Rotary positions (``GPT2Config.positions``) are written
    the same way, ``"positions": "rotary"`` and no ``wpe`` tensor, and are read back only here.

    Example (a round trip with :func:`from_pretrained`):
      >>> import tempfile
      >>> model = GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(0))
      >>> tmp = tempfile.TemporaryDirectory()
      >>> folder = save_pretrained(model, pathlib.Path(tmp.name) / "gpt2-tiny")
      >>> sorted(p.name for p in folder.iterdir())
      ['config.json', 'model.safetensors']
      >>> loaded = from_pretrained(folder)
      >>> loaded.config == model.config
      True
      >>> w, w2 = model.wte.embedding[...], loaded.wte.embedding[...]  # [V, D]
      >>> w2.shape, bool((w == w2).all())
      ((101, 48), True)
      >>> tmp.cleanup()
    """
    from safetensors.numpy import save_file

    if not isinstance(model, GPT2):
        raise TypeError(
            f"save_pretrained: `model` must be a sparse_jax GPT2; got {type(model).__name__}"
        )
    config = model.config
    if config.heads_per_layer is not None or config.inner_per_layer is not None:
        raise ValueError(
            "save_pretrained: a model with pruned heads or FFN units has no Hugging Face GPT-2 "
            "layout; save it with an Orbax checkpoint"
        )
    expected = _expected(config)
    n_params = len(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    if n_params != len(expected):
        raise ValueError(
            f"save_pretrained: the model has {n_params - len(expected)} parameters beyond GPT-2's "
            "(gates, candidate weights or α): the Hugging Face layout cannot hold them"
        )
    if dtype not in ("float32", "float16"):
        raise ValueError(
            f"save_pretrained: `dtype`={dtype!r} is not allowed; allowed: 'float32', 'float16'"
        )
    folder = pathlib.Path(path)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"save_pretrained: `path`={str(path)!r} is a file; pass a folder")
    tensors = {
        "transformer." + name: np.ascontiguousarray(
            np.asarray(_variable(model, name)[...], np.float32).astype(dtype)
        )
        for name in expected
    }
    hf = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.n_positions,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": config.n_inner,
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "activation_function": config.activation_function,
        "tie_word_embeddings": True,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    }
    if config.smear_keys:
        hf["smear_keys"] = True
    if config.smear_width != 1:
        hf["smear_width"] = config.smear_width
    if config.positions != "learned":
        hf["positions"] = config.positions
    folder.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_leftovers(folder, "partial")
    # Everything is written into a fresh sibling folder first: a new `folder` appears whole (one
    # rename) or not at all, so a save killed midway never leaves a folder that looks saved.
    tmp = sibling(folder, "partial")
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        if not folder.exists():
            try:
                os.rename(tmp, folder)
                return folder
            except OSError:  # another process made `folder` meanwhile: replace its files
                if not folder.is_dir():
                    raise
        # An existing folder: each file is replaced atomically (weights first).
        for name in ("model.safetensors", "config.json"):
            os.replace(tmp / name, folder / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
