"""A torch-free snapshot of a model's structure, taken from a module built on the meta device.

The resolver needs FQNs, classes, parameter shapes and dtypes, which parameters are tied, the
forward signatures (to map layout keys to arguments) and integer attributes (head counts). It
gets all of that from a :class:`ModelTree`, so resolving is pure and never touches real memory.
Building the module (``pkg.mod:factory`` or a Hugging Face config) also lives here.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import attrs

from hyperrecipe._files import read_regular_file
from hyperrecipe.errors import ModelSpecError, closest, did_you_mean
from hyperrecipe.refs import RefError, resolve_ref

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

__all__ = [
    "DEFAULT_HF_TASK",
    "HF_TASKS",
    "ArgInfo",
    "ModelTree",
    "ModuleInfo",
    "ParamInfo",
    "build_model",
    "default_config_note",
    "shipped_tiny_config",
    "snapshot",
    "split_hf_spec",
]

ArgKind = Literal["positional", "positional_only", "keyword_only", "var_positional", "var_keyword"]


@attrs.frozen(kw_only=True)
class ParamInfo:
    """A direct parameter of a module. ``tied_to`` is the FQN it shares storage with, if any."""

    name: str
    fqn: str
    shape: tuple[int, ...]
    dtype: str
    tied_to: str | None = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@attrs.frozen(kw_only=True)
class ArgInfo:
    """One parameter of a module's ``forward``."""

    name: str
    kind: ArgKind
    required: bool


@attrs.frozen(kw_only=True)
class ModuleInfo:
    """One module. ``torch_bases`` are the ``torch.nn`` classes it is an instance of (qualified
    names, most derived first), so the resolver can tell an ``nn.Embedding`` subclass from its
    class name alone; they are not part of the structure digest."""

    fqn: str
    cls: str
    params: tuple[ParamInfo, ...]
    int_attrs: tuple[tuple[str, int], ...]
    signature: tuple[ArgInfo, ...]
    children: tuple[str, ...]
    #: forward arguments that are integer indices (no gradient, so no backward collective): an
    #: ``nn.Embedding``'s first argument, and an ``nn.EmbeddingBag``'s offsets and sample
    #: weights too — for subclasses as well (Gemma's ``GemmaTextScaledWordEmbedding``, whose
    #: forward names its ids ``input_ids``). Not part of the structure digest.
    index_inputs: tuple[str, ...] = ()
    #: integer fields of the module's ``config`` attribute (a transformers config), which
    #: ``head_counts`` names ``config.<field>``: Phi-3's attention reads
    #: ``self.config.num_attention_heads`` in its forward. Not part of the structure digest.
    config_ints: tuple[tuple[str, int], ...] = ()

    torch_bases: tuple[str, ...] = ()

    def is_a(self, qualified_class: str) -> bool:
        """Whether the module is an instance of a ``torch.nn`` class (``"torch.nn.modules.sparse.Embedding"``)."""
        return self.cls == qualified_class or qualified_class in self.torch_bases

    def param(self, name: str) -> ParamInfo | None:
        for p in self.params:
            if p.name == name:
                return p
        return None

    def int_attr(self, name: str) -> int | None:
        """An integer attribute, or with ``config.`` an integer field of the module's config."""
        field = name.removeprefix("config.")
        for k, v in self.int_attrs if field == name else self.config_ints:
            if k == field:
                return v
        return None

    def int_attr_names(self, like: str) -> list[str]:
        """The names :meth:`int_attr` answers of the kind of ``like`` (``config.`` or not)."""
        if like.startswith("config."):
            return [f"config.{k}" for k, _ in self.config_ints]
        return [k for k, _ in self.int_attrs]

    @property
    def positional_args(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.signature if a.kind in ("positional", "positional_only"))


@attrs.frozen(kw_only=True)
class ModelTree:
    """Every module of a model, in ``named_modules`` order (parents before children)."""

    modules: tuple[ModuleInfo, ...]
    _index: dict[str, ModuleInfo] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_index", {m.fqn: m for m in self.modules})

    def module(self, fqn: str) -> ModuleInfo:
        return self._index[fqn]

    def get(self, fqn: str) -> ModuleInfo | None:
        return self._index.get(fqn)

    @property
    def fqns(self) -> tuple[str, ...]:
        return tuple(m.fqn for m in self.modules)

    def params(self) -> Iterator[ParamInfo]:
        for m in self.modules:
            yield from m.params

    def subtree(self, fqn: str) -> Iterator[ModuleInfo]:
        """The module and its descendants."""
        prefix = f"{fqn}." if fqn else ""
        for m in self.modules:
            if m.fqn == fqn or m.fqn.startswith(prefix):
                yield m

    def digest(self) -> str:
        """Hash of the structure: FQNs, classes, parameter names, shapes, dtypes and ties."""
        rows = [
            [m.fqn, m.cls, [[p.name, list(p.shape), p.dtype, p.tied_to] for p in m.params]]
            for m in self.modules
        ]
        return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


def _signature(module: nn.Module) -> tuple[ArgInfo, ...]:
    kinds: dict[inspect._ParameterKind, ArgKind] = {
        inspect.Parameter.POSITIONAL_ONLY: "positional_only",
        inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
        inspect.Parameter.KEYWORD_ONLY: "keyword_only",
        inspect.Parameter.VAR_POSITIONAL: "var_positional",
        inspect.Parameter.VAR_KEYWORD: "var_keyword",
    }
    try:
        sig = inspect.signature(type(module).forward)
    except (TypeError, ValueError):
        return ()
    params = list(sig.parameters.values())[1:]  # drop self
    return tuple(
        ArgInfo(name=p.name, kind=kinds[p.kind], required=p.default is inspect.Parameter.empty
                and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD))
        for p in params
    )


def _index_inputs(module: nn.Module, signature: tuple[ArgInfo, ...]) -> tuple[str, ...]:
    from torch import nn

    positional = [a.name for a in signature if a.kind in ("positional", "positional_only")]
    if not positional or not isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return ()
    names = {a.name for a in signature}
    extra = (("offsets", "per_sample_weights") if isinstance(module, nn.EmbeddingBag) else ())
    return (positional[0], *(n for n in extra if n in names))


def _public_ints(attributes: Mapping[str, Any]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted((k, v) for k, v in attributes.items()
                        if isinstance(v, int) and not isinstance(v, bool) and not k.startswith("_")))


def _is_config(value: object) -> bool:
    """A plain configuration object (a transformers ``PretrainedConfig``, a dataclass), not a
    module, a tensor or a builtin."""
    from torch import Tensor, nn

    return (value is not None and hasattr(value, "__dict__")
            and not callable(value) and not isinstance(value, (nn.Module, Tensor)))


def snapshot(model: nn.Module) -> ModelTree:
    """Take the structure of ``model`` (on any device; meta is cheapest)."""
    owner: dict[int, str] = {}
    modules: list[ModuleInfo] = []
    for fqn, mod in model.named_modules(remove_duplicate=True):
        params: list[ParamInfo] = []
        for name, p in mod.named_parameters(recurse=False, remove_duplicate=False):
            full = f"{fqn}.{name}" if fqn else name
            tied = owner.get(id(p))
            if tied is None:
                owner[id(p)] = full
            params.append(ParamInfo(name=name, fqn=full, shape=tuple(p.shape),
                                    dtype=str(p.dtype).removeprefix("torch."), tied_to=tied))
        ints = _public_ints(vars(mod))
        children = tuple(f"{fqn}.{c}" if fqn else c for c, _ in mod.named_children())
        config = vars(mod).get("config")
        config_ints = _public_ints(vars(config)) if _is_config(config) else ()
        signature = _signature(mod)
        bases = tuple(f"{c.__module__}.{c.__qualname__}" for c in type(mod).__mro__
                      if c.__module__.startswith("torch.nn."))
        modules.append(ModuleInfo(fqn=fqn, cls=f"{type(mod).__module__}.{type(mod).__qualname__}",
                                  params=tuple(params), int_attrs=ints, signature=signature,
                                  children=children, torch_bases=bases,
                                  index_inputs=_index_inputs(mod, signature),
                                  config_ints=config_ints))
    return ModelTree(modules=tuple(modules))


# ----------------------------------------------------------------------------- building


MAX_CONFIG_BYTES = 16 * 2**20
"""Largest model config JSON read (a transformers config is a few KB)."""


def load_model_config(config: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """A model config from a JSON file path, inline JSON text, a shipped tiny config's name
    (``tiny-llama``, see :mod:`hyperrecipe.shipped`), or a mapping.

    Raises:
        ModelSpecError: the file cannot be read (missing, not a regular file, over
            ``MAX_CONFIG_BYTES``, not UTF-8), the text is not JSON (also: a key given twice, or
            nested too deeply), or it is not a JSON object.
    """
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    text = config.strip()
    if text.startswith(("{", "[")):
        value = _parse_config_json(text, "--model-config")
    else:
        from hyperrecipe.shipped import model_config_file, model_configs

        path = Path(config)
        if not _is_file(path):
            path = model_config_file(config) or path
        if not _is_file(path):
            near = _nearest_config(config, path, model_configs())
            raise ModelSpecError(f"--model-config {config!r}: no such file and no shipped tiny "
                                 f"config of that name{near} (give a JSON file, inline JSON such as "
                                 f"'{{\"num_hidden_layers\": 2}}', or one of "
                                 f"{', '.join(model_configs()) or 'the shipped configs'})")
        try:
            raw = read_regular_file(path, limit=MAX_CONFIG_BYTES).decode("utf-8")
        except OSError as exc:
            raise ModelSpecError(f"cannot read model config {config!r}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise ModelSpecError(f"model config {config!r} is not UTF-8 text ({exc.reason} at "
                                 f"byte {exc.start})") from None
        value = _parse_config_json(raw, f"model config {config!r}")
    if not isinstance(value, dict):
        raise ModelSpecError(f"{config if len(config) < 80 else '--model-config'}: a model config "
                             f"must be a JSON object of config fields, found a JSON "
                             f"{type(value).__name__}")
    return value


def _nearest_config(config: str, path: Path, shipped: Mapping[str, Path]) -> str:
    """``"; did you mean '...'?"`` for a mistyped config file (among the JSON files of its
    folder) or shipped config name, else ``""``."""
    if "/" not in config and os.sep not in config and not config.endswith(".json"):
        return did_you_mean(config, shipped)
    try:
        names = [c.name for c in path.parent.glob("*.json")]
    except (OSError, ValueError):
        return ""
    found = closest(path.name, names, n=1)
    return f"; did you mean {str(path.parent / found[0])!r}?" if found else ""


def _is_file(path: Path) -> bool:
    """``path.is_file()``, false for names the OS refuses (too long, a NUL byte)."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} is given twice")
        out[key] = value
    return out


def _parse_config_json(text: str, source: str) -> Any:
    """JSON of a model config; a key given twice is an error (JSON would keep the last)."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise ModelSpecError(f"{source} is not valid JSON: {exc}") from None
    except ValueError as exc:
        raise ModelSpecError(f"{source}: {exc}") from None
    except RecursionError:
        raise ModelSpecError(f"{source}: JSON nested too deeply") from None


def build_model(spec: str, config: str | Mapping[str, Any] | None = None, *,
                device: str = "meta") -> nn.Module:
    """Build a model from a spec, by default on the meta device (no memory, no weights).

    Args:
        spec: ``pkg.module:factory`` (a callable returning an ``nn.Module``, called with the
            config fields as keyword arguments) or ``hf:<model_type>[/<task>]`` (a transformers
            model built by the task's Auto class, :data:`HF_TASKS`, from
            ``AutoConfig.for_model(model_type, **config)``; the task defaults to ``causal-lm``,
            ``AutoModelForCausalLM``; nothing is downloaded).
        config: a JSON file, inline JSON, or a mapping of config fields.
        device: where parameters are created (``"meta"`` for compile; a real device to run).

    Raises:
        ModelSpecError: the spec cannot be imported or called, or does not give an ``nn.Module``.
    """
    import torch
    from torch import nn

    fields = load_model_config(config)
    factory: Callable[[], Any]
    if spec.startswith("hf:"):
        factory = _hf_factory(spec, fields)
    else:
        factory = _import_factory(spec, fields)
    with torch.device(device):
        try:
            model = factory()
        except ModelSpecError:
            raise
        except Exception as exc:  # the factory is user code: report, don't trace
            raise ModelSpecError(f"building {spec!r} failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"{spec!r} returned {type(model).__name__}, not an nn.Module")
    return model


def _import_factory(spec: str, fields: dict[str, Any]) -> Callable[[], Any]:
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise ModelSpecError(f"model spec {spec!r} is neither 'pkg.module:factory' nor "
                             f"'hf:<model_type>[/<task>]'")
    try:
        target = resolve_ref(spec, "model spec", named_by_user=True)
    except RefError as exc:
        raise ModelSpecError(str(exc)) from None
    if not callable(target):
        raise ModelSpecError(f"{spec!r} is not callable")
    return lambda: target(**fields)


HF_TASKS: Mapping[str, tuple[str, str]] = {
    "causal-lm": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    "base": ("AutoModel", "MODEL_MAPPING_NAMES"),
    "masked-lm": ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    "sequence-classification": ("AutoModelForSequenceClassification",
                                "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
    "token-classification": ("AutoModelForTokenClassification",
                             "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"),
    "question-answering": ("AutoModelForQuestionAnswering",
                           "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES"),
    "seq2seq-lm": ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    "image-classification": ("AutoModelForImageClassification",
                             "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
}
"""The tasks ``hf:<model_type>/<task>`` names: task -> (transformers' Auto class, the name of
the ``modeling_auto`` table of the model types it builds). ``causal-lm`` is the default, so a
plain ``hf:llama`` builds what it always built."""

DEFAULT_HF_TASK = "causal-lm"


def split_hf_spec(spec: str) -> tuple[str, str]:
    """``hf:<model_type>[/<task>]`` as ``(model_type, task)``; the task defaults to
    ``causal-lm``, and ``hf:bert/`` gives an empty task. Neither part is checked here
    (:func:`build_model` does)."""
    model_type, sep, task = spec.removeprefix("hf:").partition("/")
    return model_type, task if sep else DEFAULT_HF_TASK


def _task_tables() -> dict[str, Mapping[str, str]]:
    from transformers.models.auto import modeling_auto

    return {task: getattr(modeling_auto, table) for task, (_, table) in HF_TASKS.items()}


def _check_task(model_type: str, task: str, spec: str) -> str:
    """The Auto class of ``task`` for ``model_type``, or a :class:`ModelSpecError` that names the
    tasks there are (closest first) or those this model type has."""
    names = ", ".join(HF_TASKS)
    if task not in HF_TASKS:
        by_class = {auto.lower(): t for t, (auto, _) in HF_TASKS.items()}
        if task.lower() in by_class:
            hint = f"; spell {task} as hf:{model_type}/{by_class[task.lower()]}"
        else:
            hint = did_you_mean(task, HF_TASKS)
        raise ModelSpecError(f"--model {spec}: no task {task!r}{hint} (hf:<model_type>/<task> "
                             f"takes one of: {names}; hf:{model_type} alone means "
                             f"{DEFAULT_HF_TASK})")
    tables = _task_tables()
    if model_type not in tables[task]:
        has = [t for t, table in tables.items() if model_type in table]
        offer = (f"{model_type} has: " + ", ".join(f"hf:{model_type}/{t}" for t in has)
                 if has else f"transformers has no Auto class for {model_type} among: {names}; "
                 f"build it with a pkg.module:factory of your own")
        raise ModelSpecError(f"--model {spec}: transformers has no {task} model for "
                             f"{model_type!r} ({HF_TASKS[task][0]} does not list it); {offer}")
    return HF_TASKS[task][0]


def _hf_factory(spec: str, fields: dict[str, Any]) -> Callable[[], Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_type, task = split_hf_spec(spec)
    try:
        import transformers
    except ImportError:
        raise ModelSpecError("--model hf:... needs transformers: pip install 'hyperrecipe[hf]'") from None
    from transformers import CONFIG_MAPPING, AutoConfig

    known = list(CONFIG_MAPPING.keys())
    if model_type not in known:
        shown = model_type if len(model_type) <= 80 else model_type[:80] + "..."
        raise ModelSpecError(
            f"--model hf:{shown}: transformers {transformers.__version__} has no model type "
            f"{shown!r}{did_you_mean(model_type, known)}; use the config's `model_type` "
            f"(hf:llama, hf:qwen2, hf:gpt2, ...: {len(known)} are known)")
    auto_class: Any = getattr(transformers, _check_task(model_type, task, spec))
    _check_family(spec, fields, CONFIG_MAPPING[model_type])
    # a config.json from a checkpoint names its model_type (checked above): for_model takes
    # the type positionally and raised "got multiple values for argument 'model_type'"
    fields = {k: v for k, v in fields.items() if k != "model_type"}
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except Exception as exc:  # noqa: BLE001 - transformers validates fields with its own types
        # (huggingface_hub's StrictDataclass*Error derive from Exception only); the config is
        # the user's data: say which field is wrong, without a traceback.
        detail = " ".join(str(exc).split())
        raise ModelSpecError(f"hf:{model_type}: the model config is not valid for this family: "
                             f"{detail[:500]}") from None
    del transformers

    def make() -> Any:
        return auto_class.from_config(config)

    return make


_RUN_TIME_FIELDS = frozenset({"attn_implementation", "experts_implementation", "dtype",
                               "torch_dtype"})
"""Config keywords transformers takes for every family without listing them in ``to_dict``."""


def _check_family(spec: str, fields: Mapping[str, Any], config_class: Any) -> None:
    """Refuse a config written for another family: transformers keeps fields it does not know
    as plain attributes, so ``--model hf:llama --model-config tiny-gpt2`` silently built the
    default Llama (6.7 B parameters: on the meta device for compile, for real in ``check``)."""
    model_type, sep, task = spec.removeprefix("hf:").partition("/")
    given = fields.get("model_type")
    if isinstance(given, str) and given != model_type:
        raise ModelSpecError(f"--model {spec} with a {given!r} config (its model_type); "
                             f"use --model hf:{given}{sep}{task}, or a config for {model_type}")
    aliases = dict(getattr(config_class, "attribute_map", {}) or {})
    known = set(config_class().to_dict()) | set(aliases) | _RUN_TIME_FIELDS
    known |= set(inspect.signature(config_class.__init__).parameters)
    unknown = sorted(set(fields) - known - {"model_type"})
    sizes = {"hidden_size", "num_hidden_layers"}
    # attribute_map maps the common name to the family's own: T5's hidden_size is d_model
    sized = any(aliases.get(k, k) in sizes or k in sizes for k in fields) or any(
        alias in fields for alias, target in aliases.items() if target in sizes) or any(
        aliases.get(size) in fields for size in sizes)
    if unknown and not sized:
        near = ", ".join(k + "".join(f" (did you mean {c!r}?)" for c in closest(k, known, n=1))
                         for k in unknown[:6]) + (", ..." if len(unknown) > 6 else "")
        raise ModelSpecError(
            f"--model {spec}: the model config sets neither hidden_size nor "
            f"num_hidden_layers of {config_class.__name__}, and has fields it does not know "
            f"({near}): it looks like a config for another family, and would build "
            f"transformers' default size; give a {model_type} config (e.g. --model-config "
            f"tiny-{model_type} where one ships), or also set hidden_size and num_hidden_layers")


def shipped_tiny_config(spec: str) -> str | None:
    """The tiny config shipped for ``hf:<model_type>`` (``recipes/models/tiny-<type>.json``),
    as a path relative to the working directory when it is below it; ``None`` if none ships."""
    from hyperrecipe.recipe.loader import shipped_recipe_dir

    if not spec.startswith("hf:"):
        return None
    path = shipped_recipe_dir() / "models" / f"tiny-{split_hf_spec(spec)[0]}.json"
    if not path.is_file():
        return None
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def default_config_note(spec: str, model: nn.Module, *, tiny_config: str | None = None) -> str:
    """Say that ``hf:<model_type>`` was built from transformers' default config, and how big
    that is — the default of most families is a multi-billion-parameter model, which is not what
    a user who forgot ``--model-config`` meant to compile or run.

    Args:
        spec: the ``hf:<model_type>`` spec.
        model: the model built from it (on any device; meta is enough).
        tiny_config: a small config to suggest instead, if one ships.

    Returns:
        One line, e.g. ``"--model hf:llama without --model-config: transformers' default
        LlamaConfig (32 layers, hidden size 4096, vocab 32000; 6.74 B parameters, 25.1 GiB in
        float32); ..."``.
    """
    config = getattr(model, "config", None)
    sizes = []
    for attr, label in (("num_hidden_layers", "layers"), ("hidden_size", "hidden size"),
                        ("vocab_size", "vocab")):
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            sizes.append(f"{value} {label}" if label == "layers" else f"{label} {value}")
    params = list(model.parameters())  # tied parameters once
    count = sum(p.numel() for p in params)
    nbytes = sum(p.numel() * p.element_size() for p in params)
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params})
    size = f"{count / 1e9:.2f} B parameters" if count >= 10**8 else f"{count:,} parameters"
    what = f"{', '.join(sizes)}; " if sizes else ""
    hint = f", e.g. --model-config {tiny_config}" if tiny_config else ""
    return (f"--model {spec} without --model-config: transformers' default "
            f"{type(config).__name__} ({what}{size}, {nbytes / 2**30:.1f} GiB in "
            f"{'/'.join(dtypes) or 'no dtype'}); pass --model-config FILE or inline JSON for "
            f"another size{hint}")
