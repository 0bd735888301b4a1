"""Piper from Python: compile, simulate, sweep and tune distributed-training strategies, train a plan
on the host backend, and plot results, as the ``piper`` command does.

Every function takes keyword arguments named after the CLI's flags (``engine=``, ``cluster=``,
``devices=``, ...) and returns the JSON shapes of the CLI's files as Python dicts and lists. The
results of simulate, sweep, tune and run also have a table form: ``to_records()`` (a list of flat
dicts with stable column names, ``None`` where there is no value) and ``to_dataframe()`` (pandas).

Bad input raises :class:`InputError` (a ``ValueError``) with one line naming the keyword or field
that was wrong; an unknown keyword raises ``TypeError`` with the nearest valid one.
"""

import csv as _csv
import difflib as _difflib
import functools as _functools
import inspect as _inspect
import io as _io
import json as _json
import math as _math
import os as _os
import re as _re
import shutil as _shutil
import subprocess as _subprocess
import tempfile as _tempfile

from . import _piper

__version__: str = _piper.__version__

__all__ = [
    "PiperError", "InputError", "InternalError", "RunError", "Error",
    "Report", "SweepResult", "TuneResult", "RunResult", "Results",
    "compile", "directives", "simulate", "verify", "sweep", "tune", "run", "plot", "read_results", "models",
    "schedule_show", "strategy", "strategy_settings", "__version__",
]


# ---------------------------------------------------------------------------------------------
# Exceptions


class PiperError(Exception):
    """Base class of every error piper raises."""


class InputError(PiperError, ValueError):
    """Bad input: one line naming the keyword, field or file that was wrong (the CLI's exit 2)."""


class InternalError(PiperError, RuntimeError):
    """A bug in piper, not in the input (the CLI's exit 3). Please report it."""


class RunError(PiperError, RuntimeError):
    """``run``: training started but did not finish (a rank failed or stalled; the CLI's exit 4)."""


#: The name of :class:`InputError` before the exception hierarchy existed.
Error = InputError


def _did_you_mean(value, choices):
    close = _difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


_SCALARS = (str, int, float, bool)


def _accepted_types(annotation):
    """The types a parameter annotated `str`, `int`, `float`, `bool` (or one of them `| None`) takes,
    and whether None is one; None for other annotations (checked where they are used)."""
    if annotation in _SCALARS:
        return (annotation,), False
    args = getattr(annotation, "__args__", None)
    if args and len(args) == 2 and type(None) in args:
        other = args[0] if args[1] is type(None) else args[1]
        if other in _SCALARS:
            return (other,), True
    return None


def _type_ok(value, kind):
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, (str, _os.PathLike))  # str: a name or a path


def _keywords(fn):
    """Gives `fn` a TypeError with a suggestion for an unknown keyword, and a one-line TypeError for
    an argument of the wrong type where its annotation is a plain str/int/float/bool (optionally
    `| None`): `reference="no"` used to be truthy, `cluster=5` reached pybind11's many-line error,
    `trace=True` became a file named 'True'. Keeps `fn`'s signature."""
    sig = _inspect.signature(fn)
    names = [n for n, p in sig.parameters.items() if p.kind is not _inspect.Parameter.POSITIONAL_ONLY]
    checked = {n: t for n, p in sig.parameters.items() if (t := _accepted_types(p.annotation)) is not None}

    @_functools.wraps(fn)
    def wrapper(*args, **kwargs):
        for k in kwargs:
            if k not in names:
                raise TypeError(f"{fn.__name__}() got an unexpected keyword argument {k!r}"
                                f"{_did_you_mean(k, names)}") from None
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError:
            return fn(*args, **kwargs)  # Python's own message for a missing or extra argument
        for k, v in bound.arguments.items():
            if k not in checked or (v is None and checked[k][1]):
                continue
            (kind,), optional = checked[k]
            if not _type_ok(v, kind):
                want = {str: "a str", int: "an int", float: "a number", bool: "a bool (True or False)"}[kind]
                raise TypeError(f"{fn.__name__}() argument {k}={v!r}: must be {want}{' or None' if optional else ''}, "
                                f"not {type(v).__name__}") from None
        return fn(*args, **kwargs)

    return wrapper


# Native messages name the CLI's flags ("--engine 'analytc': ...", "--pp 3: ...", "--recompute: ...");
# in Python they name the keyword ("engine='analytc': ...", "pp=3: ...", "recompute: ...").
_FLAG = _re.compile(r"(?<![\w-])--([a-z][a-z0-9-]*)(?: '([^']*)'| ([^\s:,;()']+)(?=[:,;)]))?")


def _speak(message, flags):
    def keyword(m):
        if m.group(1) not in flags:
            return m.group(0)
        kw = flags[m.group(1)]
        if m.group(2) is not None:
            return f"{kw}={m.group(2)!r}"
        if m.group(3) is not None:
            v = m.group(3)
            return f"{kw}={v}" if _re.fullmatch(r"-?[\d.]+(?:e-?\d+)?", v) else f"{kw}={v!r}"
        return kw
    return _FLAG.sub(keyword, message)


def _native(fn, *args, flags=None, files=None):
    """Calls the native function; its errors become InputError / InternalError naming the keywords
    (`flags`: CLI flag -> keyword; `files`: keyword -> the file name it gave, which the native
    message starts with)."""
    try:
        return fn(*args)
    except _piper.NativeInputError as e:
        message = _speak(str(e), flags or {})
        for kw, path in (files or {}).items():
            if path and isinstance(path, str) and message.startswith(f"{path}: "):
                rest = message[len(path) + 2:]
                # "neither a zoo model (a, b, ...) nor a readable file": suggest the nearest name.
                names = _re.search(r"\(([\w.-]+(?:, [\w.-]+)+)\)", rest)
                hint = _did_you_mean(path, names.group(1).split(", ")) if names else ""
                message = f"{kw}={path!r}: " + rest + hint
                break
        raise InputError(message) from None
    except _piper.NativeInternalError as e:
        raise InternalError(f"{e} (please report this: it is a bug in piper, not in the input)") from None


def _bad(keyword, value, why):
    raise InputError(f"{keyword}={value!r}: {why}")


def _check_choice(keyword, value, choices, what):
    if value not in choices:
        _bad(keyword, value, f"unknown {what}{_did_you_mean(value, choices)}; expected one of: {', '.join(choices)}")


# The largest integer a keyword takes: the C++ side holds them as int (2**31 and more reached
# pybind11 as "Unable to cast Python instance to C++ type", a RuntimeError).
_INT_MAX = 2**31 - 1


def _check_int(keyword, value, minimum=1, maximum=_INT_MAX):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _bad(keyword, value, "must be an integer >= %d" % minimum)
    if value > maximum:
        _bad(keyword, value, "must be an integer from %d to %d" % (minimum, maximum))


def _check_number(keyword, value, minimum=0.0, positive=False):
    """A finite number >= minimum (> 0 when `positive`): inf and nan are refused, not taken as "no limit"."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not _math.isfinite(value)
            or not value >= minimum or (positive and not value > 0)):
        _bad(keyword, value, "must be a finite number " + ("> 0" if positive else ">= %g" % minimum))


def _check_plain(obj, what):
    """A dict or list that crosses to C++ as JSON: str keys, finite numbers, JSON types only, named by
    field path. json.dumps turned {1: 2} into {"1": 2} and nan into a parse error that named nothing."""
    stack = [(obj, "", 0)]
    while stack:
        v, path, depth = stack.pop()
        where = f"{what}: field '{path}'" if path else what
        if depth > 1000:
            raise InputError(f"{where}: nested more than 1000 deep")
        if isinstance(v, dict):
            for k, x in v.items():
                if not isinstance(k, str):
                    raise InputError(f"{where}: key {k!r} is not a str ({type(k).__name__})")
                _check_utf8(k, where)
                stack.append((x, f"{path}.{k}" if path else k, depth + 1))
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                stack.append((x, f"{path}[{i}]", depth + 1))
        elif isinstance(v, str):
            _check_utf8(v, where)
        elif isinstance(v, float) and not _math.isfinite(v):
            raise InputError(f"{where}: {v!r} is not a JSON number (finite numbers only)")
        elif v is not None and not isinstance(v, (str, int, float, bool)):
            raise InputError(f"{where}: {type(v).__name__} is not a JSON type (dicts, lists, str, numbers, bools, None)")


def _check_utf8(text, where):
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"{where}: {text!r} is not valid Unicode (a lone surrogate at {e.start})") from None


def _int_list(keyword, value, minimum=1, maximum=_INT_MAX):
    """An int or a list of ints (a pin or the values to try); None is empty (every legal one)."""
    if value is None:
        return []
    items = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    try:
        items = list(items)
    except TypeError:
        _bad(keyword, value, "must be an integer or a list of integers")
    if not items:
        _bad(keyword, value, "must not be empty (leave it out for every legal value)")
    for v in items:
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum or (maximum is not None and v > maximum):
            above = isinstance(v, int) and v > maximum
            bounds = f">= {minimum}" if maximum == _INT_MAX and not above else f"from {minimum} to {maximum}"
            _bad(keyword, value, f"every value must be an integer {bounds} ({v!r} is not)")
    return items


def _str_list(keyword, value, choices, what):
    if value is None:
        return []
    items = [value] if isinstance(value, str) else list(value)
    if not items:
        _bad(keyword, value, "must not be empty (leave it out for every value)")
    for v in items:
        if v not in choices:
            _bad(keyword, value, f"unknown {what} {v!r}{_did_you_mean(v, choices)}; expected: {', '.join(choices)}")
    return items


def _check_engine(engine, keyword="engine"):
    if engine:
        _check_choice(keyword, engine, _piper.engine_names(), "engine")


def _check_cluster(cluster, base_dir, keyword="cluster"):
    if not cluster or not isinstance(cluster, str):
        return
    if cluster.lstrip().startswith("{"):
        # A spec written inline (as --cluster takes one): the loader checks it, and names the field.
        try:
            _piper.check_cluster(cluster)
        except _piper.NativeInputError as e:
            _bad(keyword, cluster, str(e).removeprefix("--cluster: "))
        return
    presets = _piper.cluster_presets()
    path = cluster if _os.path.isabs(cluster) or not base_dir else _os.path.join(base_dir, cluster)
    if cluster not in presets and not _os.path.exists(path):
        _bad(keyword, cluster, f"neither a preset nor a file{_did_you_mean(cluster, presets)}; presets: {', '.join(presets)}")


def _with_runtime(cluster, base_dir, runtime, attention_kernel, keyword="cluster"):
    """`cluster` (a preset or file; "" the default) costed under the named training runtime: the derived
    cluster spec ``piper simulate --runtime / --attention-kernel`` makes ({"cluster": ..., "runtime":
    ..., "attention_kernel": ...}, inline; docs/simulator.md). Unchanged when neither is given."""
    if not runtime and not attention_kernel:
        return cluster
    if runtime:
        _check_choice("runtime", runtime, _piper.runtime_profiles(), "runtime profile")
    base = cluster or "dgx-h200"
    if base not in _piper.cluster_presets() and base_dir and not _os.path.isabs(base):
        base = _os.path.join(base_dir, base)
    text = _piper.derived_cluster_spec(base, runtime or "", attention_kernel or "")
    try:
        _piper.check_cluster(text)
    except _piper.NativeInputError as e:
        message = str(e)
        lead = "--cluster: field 'attention_kernel': "
        if message.startswith(lead):
            _bad("attention_kernel", attention_kernel, message[len(lead):])
        lead = "--cluster: field 'cluster': "
        raise InputError(f"{keyword}={cluster!r}: " + message[len(lead):] if message.startswith(lead) else message) from None
    return text


def _read_native(read, path, what):
    """`read(path)` of the native module (the CLI's bounded readers); a file that does not open is named
    as the keyword that gave it (``what='path'``)."""
    try:
        return read(path)
    except _piper.NativeInputError as e:
        message = str(e)
        if message.startswith(f"{path}: cannot open"):
            message = f"{what}={path!r}: " + message[len(path) + 2:]
        raise InputError(message) from None


def _load(obj, what, base_dir):
    """A dict as given, or a JSON file's content (relative names in it then resolve against its folder)."""
    if isinstance(obj, (str, _os.PathLike)):
        path = _os.fspath(obj)
        # Read and parsed as the CLI reads a file: the input-bytes and json-depth limits, duplicate
        # keys refused (Python's open().read() ran /dev/zero out of memory; json.loads kept the last
        # of two keys).
        obj = _read_native(_piper.read_json, path, what)
        if not base_dir:
            base_dir = _os.path.dirname(_os.path.abspath(path))
    else:
        _check_plain(obj, what)
    return obj, base_dir


def _model_of(scenario):
    return {"scenario['model']": scenario.get("model")} if isinstance(scenario, dict) else {}


# ---------------------------------------------------------------------------------------------
# Table forms


def _dataframe(records, columns):
    try:
        import pandas
    except ImportError:
        raise ImportError("to_dataframe() needs pandas (pip install pandas); to_records() gives the same rows "
                          "as a list of dicts") from None
    return pandas.DataFrame.from_records(records, columns=columns)


class _Table:
    """to_records() and to_dataframe() over a result's rows."""

    def columns(self) -> list:
        """The column names of to_records(), in order."""
        raise NotImplementedError

    def to_records(self) -> list:
        raise NotImplementedError

    def to_dataframe(self):
        """The records as a pandas DataFrame (columns in order); needs pandas."""
        return _dataframe(self.to_records(), self.columns())


class Report(_Table, dict):
    """A simulation report (the dict ``piper simulate --report`` writes); to_records() has one row per device."""

    def columns(self):
        base = ["device", "busy_s", "idle_s", "bubble_fraction", "comm_s", "comm_compute_overlap", "tp_comm_s",
                "peak_memory_bytes", "peak_memory_time_s", "hbm_bytes", "oom"]
        return base + [f"peak_{k}_bytes" for k in _piper.buffer_kinds()]

    def to_records(self):
        kinds = _piper.buffer_kinds()
        out = []
        for d in self.get("per_device", []):
            r = {c: d.get(c) for c in self.columns()[:11]}
            by_kind = d.get("peak_bytes_by_kind") or {}
            for k in kinds:
                r[f"peak_{k}_bytes"] = by_kind.get(k)
            out.append(r)
        return out


class SweepResult(_Table, dict):
    """``sweep``'s summary; ``rows`` (and to_records()) are the rows run now, keyed by the CSV's columns."""

    def columns(self):
        return list(_piper.sweep_columns())

    def to_records(self):
        cols = self.columns()
        # An empty reason is no reason: None, as read_results() reads the CSV's blank.
        return [{c: (None if c == "reason" and row.get(c) == "" else row.get(c)) for c in cols}
                for row in self.get("rows", [])]


class TuneResult(_Table, dict):
    """``tune``'s summary; ``ranked`` (and to_records()) are the plans that fit, best first."""

    _fields: list = []

    def columns(self):
        return ["rank"] + list(_piper.tune_columns()) + ["strategy"]

    def to_records(self):
        return [dict(r) for r in self.get("ranked", [])]

    def directives(self, rank: int = 1) -> list:
        """The directive program of the plan at `rank` (1: the best), as ``piper tune --emit-directives``."""
        return self._outputs(rank)["directives"]

    def scenario(self, rank: int = 1) -> dict:
        """The scenario of the plan at `rank` (1: the best), as ``piper tune --emit-scenario``; simulate() takes it."""
        return self._outputs(rank)["scenario"]

    def _outputs(self, rank):
        ranked = self.get("ranked", [])
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= len(ranked):
            _bad("rank", rank, f"must be from 1 to {len(ranked)} (the ranked plans)")
        fields = self._fields[rank - 1]
        return _native(_piper.tune_outputs, fields)


class RunResult(_Table, dict):
    """``run``'s report (the run.json ``piper run --report`` writes); to_records() has one row per step."""

    def columns(self):
        return ["step", "loss", "step_time_s"]

    def to_records(self):
        first = self.get("first_step", 0)
        times = self.get("step_times_s") or []
        return [{"step": first + i + 1, "loss": loss, "step_time_s": times[i] if i < len(times) else None}
                for i, loss in enumerate(self.get("losses", []))]


# ---------------------------------------------------------------------------------------------
# Compiler and simulator


@_keywords
def compile(scenario, *, base_dir: str = "") -> dict:
    """Compile a scenario (a dict, or a scenario file's path) into the Program dict ``piper compile -o`` writes.

    Relative file names in the scenario resolve against `base_dir` (default: the scenario file's
    folder, or the current directory for a dict).
    """
    scenario, base_dir = _load(scenario, "scenario", base_dir)
    if isinstance(scenario, dict):  # checked as simulate checks them, though a compile does not use them
        _check_engine(scenario.get("engine"), "scenario['engine']")
        _check_cluster(scenario.get("cluster"), base_dir, "scenario['cluster']")
    return _native(_piper.compile, scenario, base_dir, files=_model_of(scenario))


@_keywords
def directives(scenario, *, base_dir: str = "") -> list:
    """The directive program (a list) a scenario compiles; without ``model``, the one ``piper directives`` prints."""
    scenario, base_dir = _load(scenario, "scenario", base_dir)
    return _native(_piper.directives, scenario, base_dir, files=_model_of(scenario))


@_keywords
def simulate(scenario=None, *, plan=None, cluster: str = "", engine: str = "", calibration: str = "",
             runtime: str = "", attention_kernel: str = "", base_dir: str = "") -> Report:
    """Simulate a scenario (dict or file) or ``plan=`` (a Program dict or file): the report ``piper simulate --report`` writes.

    `cluster` (a preset or a cluster file) and `engine` (``"analytic"`` or ``"simgrid"``) override the
    scenario's; `runtime` (``"eager"``, ...) and `attention_kernel` (``"fa2"``, ``"fa1"``) cost it under
    that training runtime, as ``--runtime`` and ``--attention-kernel`` do; `calibration` is a
    measured-times file (``piper run --calibrate``). The result is a :class:`Report` (a dict) whose
    to_records() has one row per device.
    """
    if (scenario is None) == (plan is None):
        raise InputError("simulate: give a scenario or plan=, not both or neither")
    _check_engine(engine)
    if scenario is not None:
        scenario, base_dir = _load(scenario, "scenario", base_dir)
        if not engine and isinstance(scenario, dict):
            _check_engine(scenario.get("engine"), "scenario['engine']")
        if not cluster and isinstance(scenario, dict):
            _check_cluster(scenario.get("cluster"), base_dir, "scenario['cluster']")
    else:
        plan, _ = _load(plan, "plan", base_dir)
    _check_cluster(cluster, base_dir)
    flags = {"engine": "engine", "cluster": "cluster"}
    if scenario is not None and isinstance(scenario, dict):
        if not engine and scenario.get("engine"):
            flags["engine"] = "scenario['engine']"
        if not cluster and scenario.get("cluster"):
            flags["cluster"] = "scenario['cluster']"
    if runtime or attention_kernel:
        own = scenario.get("cluster", "") if not cluster and isinstance(scenario, dict) else ""
        cluster = _with_runtime(cluster or own, base_dir, runtime, attention_kernel,
                                "scenario['cluster']" if own else "cluster")
    files = {"calibration": calibration}
    if isinstance(scenario, dict):
        files["scenario['model']"] = scenario.get("model")
    return Report(_native(_piper.simulate, scenario, plan, cluster, engine, calibration, base_dir, flags=flags,
                          files=files))


@_keywords
def verify(plan) -> list:
    """Verify a Program (dict or file); returns the issues as ``[{"check", "message"}]`` (empty: it verifies)."""
    plan, _ = _load(plan, "plan", "")
    return _native(_piper.verify, plan)


@_keywords
def sweep(spec, *, output: str | None = None, jobs: int = 1, base_dir: str = "") -> SweepResult:
    """Run a sweep spec (dict or file), as ``piper sweep spec.json -o output``.

    With `output` the rows are appended to that CSV and a rerun resumes from it; without it they go to
    a temporary file that is removed. Returns a :class:`SweepResult`: ``combinations``, ``resumed``,
    ``ran``, ``ok``, ``invalid``, ``failed`` and ``rows`` (the rows run now, keyed by the CSV's
    columns, ``None`` where the CSV is blank).
    """
    _check_int("jobs", jobs)
    spec, base_dir = _load(spec, "spec", base_dir)
    if output is not None:
        output = _os.fspath(output)
    return SweepResult(_native(_piper.sweep, spec, output, jobs, base_dir))


_INT_COLUMNS = {"devices", "global_batch", "seq_len", "pp", "dp", "ep", "tp", "cp", "etp", "comm_sms", "dp_shard", "zero",
                "virtual", "microbatches", "micro_batch_size", "estimated_memory_bytes", "peak_memory_bytes"}
_FLOAT_COLUMNS = {"bucket_mb", "step_time_s", "tokens_per_s", "mfu", "bubble_fraction", "compile_time_s", "simulate_time_s",
                  "tp_comm_s"}
_BOOL_COLUMNS = {"sequence_parallel", "oom"}


_STR_COLUMNS = {"key", "model", "cluster", "engine", "schedule", "recompute", "reduce_every", "placement",
                "pp_ranges", "rank_order", "status", "reason"}


def _setting_types():
    """Column -> Python type of every strategy setting (the settings table; its names are CSV columns)."""
    kinds = {"int": int, "double": float, "bool": bool, "string": str}
    return {s["name"]: kinds[s["type"]] for s in _piper.strategy_settings()}


_SETTING_TYPES = _setting_types()


_INTEGER = _re.compile(r"[+-]?[0-9]+")
_DECIMAL = _re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def _number(kind, text):
    """`text` as int or float where it is a number in decimal as the CLI reads one (cli/common.hpp
    decimal_number): Python's int() and float() also took "1_000", a fullwidth "１", "inf" and "nan",
    which `piper plot` does not count as numbers. ValueError otherwise."""
    if not (_INTEGER if kind is int else _DECIMAL).fullmatch(text):
        raise ValueError(f"{text!r} is not a number in decimal")
    value = kind(text)
    if kind is float and not _math.isfinite(value):  # "1e400": the CLI's strtod overflows, not a number
        raise ValueError(f"{text!r} is out of range")
    return value


def _typed(column, text):
    """A field of a results CSV as Python reads it: blank is None (no value), never 0. The columns of
    sweep and tune files have their types; other columns are int, float or str, whichever parses."""
    if _SETTING_TYPES.get(column) is str:
        return text  # a string setting's blank is its value ("": reduce_every's default), not a missing figure
    if text == "":
        return None
    if column in _INT_COLUMNS:
        return _number(int, text)
    if column in _FLOAT_COLUMNS:
        return _number(float, text)
    if column in _BOOL_COLUMNS:
        return text == "1"
    if column in _STR_COLUMNS:
        return text
    kind = _SETTING_TYPES.get(column)
    if kind is bool:
        return text == "1"
    if kind in (int, float):
        return _number(kind, text)
    if kind is not None:
        return kind(text)
    for kind in (int, float):
        try:
            return _number(kind, text)
        except ValueError:
            pass
    return text


class Results(_Table, list):
    """A results CSV read by read_results(): a list of records (dicts keyed by the header's columns)."""

    def __init__(self, records=(), columns=()):
        super().__init__(records)
        self._columns = list(columns)

    def columns(self):
        return list(self._columns)

    def to_records(self):
        return [dict(r) for r in self]


def strategy_settings() -> list:
    """The strategy settings table (the one ``piper compile --help``, scenario files and results CSVs
    use): ``[{name, flag, type, default, help, choices?, min?, max?}]``, in table order."""
    return _piper.strategy_settings()


def strategy(**settings) -> dict:
    """A scenario's ``"strategy"`` dict from keyword arguments named as the settings table names them
    (``pp``, ``zero``, ``dp_shard``, ...; see :func:`strategy_settings`): every setting, the ones not
    given at their defaults. An unknown keyword or a bad value raises InputError naming it (with a
    suggestion for a misspelt one)."""
    _check_plain(settings, "strategy")
    flags = {s["flag"][2:]: s["name"] for s in _piper.strategy_settings()}
    return _native(_piper.strategy, settings, flags=flags)


# The keywords of strategy() are the table's settings, keyword-only with the table's defaults, so
# help() and inspect show them; the table, not this file, lists them.
strategy.__signature__ = _inspect.Signature(
    [_inspect.Parameter(s["name"], _inspect.Parameter.KEYWORD_ONLY, default=s["default"])
     for s in _piper.strategy_settings()], return_annotation=dict)


def _csv_rows(path):
    """A CSV file's rows, read as the CLI reads an input (bounded by the input-bytes limit: open().read()
    of /dev/zero ran out of memory), as UTF-8 with a leading byte-order mark dropped (it became part of
    the first column's name), its quoting strict (`1,"2"3` read as 23)."""
    data = _read_native(_piper.read_input, path, "csv")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: byte {e.start}: not UTF-8 text (a results CSV is UTF-8)") from None
    try:
        return list(_csv.reader(_io.StringIO(text, newline=""), strict=True))
    except _csv.Error as e:
        raise InputError(f"{path}: not a well-formed CSV: {e}") from None


@_keywords
def read_results(csv: str) -> Results:
    """Read a results CSV (``piper sweep -o``, ``piper tune -o``, or any CSV with a header) by column name.

    Returns :class:`Results`, a list with one dict per row keyed by the header's columns: numbers as
    int or float, 0/1 flags of sweep and tune files as bools, blanks as ``None`` (a row that was not
    simulated has no figures, never 0). to_dataframe() makes it a pandas DataFrame.
    """
    path = _os.fspath(csv)
    rows = _csv_rows(path)
    if not rows:
        raise InputError(f"{path}: empty file (expected a header line)")
    header = rows[0]
    out = []
    for n, fields in enumerate(rows[1:], start=2):
        if not fields:
            continue
        if len(fields) != len(header):
            raise InputError(f"{path}: line {n}: {len(fields)} fields, the header has {len(header)}")
        try:
            out.append({c: _typed(c, f) for c, f in zip(header, fields)})
        except ValueError as e:
            raise InputError(f"{path}: line {n}: {e}") from None
    return Results(out, header)


@_keywords
def tune(model: str, *, devices: int, cluster: str = "dgx-h200", global_batch: int | None = None,
         seq_len: int | None = None, micro_batch_size=(1, 2), zero=(0, 1, 2, 3), pp=None, dp=None, ep=None,
         tp=None, etp=None, sequence_parallel: str = "both", recompute=("none", "selective", "full"), comm_sms=None,
         dp_shard=None, reduce_every=None, schedules=None, max_virtual: int = 4,
         memory_cap_gib: float | None = None, memory_reserve_gib: float | None = None,
         budget_s: float | None = None, top: int = 3, placement_search: bool = True, show: int = 10,
         jobs: int | None = None, output: str | None = None, runtime: str = "",
         attention_kernel: str = "") -> TuneResult:
    """Search the strategy space with the simulator, as ``piper tune``; the plans that fit, best first.

    `pp`, `dp`, `ep`, `tp`, `etp`, `zero`, `micro_batch_size`, `comm_sms` and `dp_shard` take one value (a
    pin) or a list of values to try; left out, every legal value is tried (as the CLI's defaults).
    `sequence_parallel` is ``"on"``, ``"off"`` or ``"both"`` (or a bool). The memory cap is the GPU's
    HBM less `memory_reserve_gib` (default 5 % of the HBM), or `memory_cap_gib`. `runtime` and
    `attention_kernel` cost every plan under that training runtime (``--runtime``,
    ``--attention-kernel``). `show` plans are
    exact (branch and bound keeps them); `top` are re-simulated on SimGrid. With `output` the rows go
    to that CSV and a rerun resumes; without it, to a temporary file that is removed. `jobs`
    defaults to the CPU count.

    Returns a :class:`TuneResult`: the summary (``memory_cap_bytes``, ``memory_reserve_bytes``,
    ``candidates``, ``pruned``, ``simulated``, ``fitting``, ...) and ``ranked``: the best `show`
    plans that fit (the table ``piper tune`` prints), one dict each with the tune CSV's columns,
    ``rank`` and ``strategy``; empty when nothing fits.
    """
    if not isinstance(model, str) or not model:
        _bad("model", model, "must be a zoo name or a model file")
    _check_int("devices", devices)
    _check_cluster(cluster, "")
    cluster = _with_runtime(cluster, "", runtime, attention_kernel)
    if global_batch is not None:
        _check_int("global_batch", global_batch)
    if seq_len is not None:
        _check_int("seq_len", seq_len)
    if sequence_parallel is True or sequence_parallel is False:
        sequence_parallel = "on" if sequence_parallel else "off"
    _check_choice("sequence_parallel", sequence_parallel, ["on", "off", "both"], "value")
    _check_int("max_virtual", max_virtual)
    if memory_cap_gib is not None and memory_reserve_gib is not None:
        raise InputError("memory_cap_gib and memory_reserve_gib: give one (the cap is the whole budget; the reserve "
                         "is taken off the HBM)")
    if memory_cap_gib is not None:
        _check_number("memory_cap_gib", memory_cap_gib, positive=True)  # 0 used to mean the default cap
    if memory_reserve_gib is not None:
        _check_number("memory_reserve_gib", memory_reserve_gib)
    if budget_s is not None:
        _check_number("budget_s", budget_s)
    _check_int("top", top, 0)
    _check_int("show", show)
    if jobs is None:
        jobs = _os.cpu_count() or 1
    _check_int("jobs", jobs)
    gib = 1024.0 ** 3
    args = {
        "model": model, "cluster": cluster, "devices": devices, "global_batch": global_batch or 0,
        "seq_len": seq_len or 0,
        "micro_batch_size": _int_list("micro_batch_size", micro_batch_size),
        "zero": _int_list("zero", zero, 0, 3),
        "pp": _int_list("pp", pp), "dp": _int_list("dp", dp), "ep": _int_list("ep", ep), "tp": _int_list("tp", tp),
        "etp": _int_list("etp", etp),
        "sequence_parallel": {"on": [True], "off": [False], "both": [False, True]}[sequence_parallel],
        "recompute": _str_list("recompute", recompute, ["none", "selective", "full", "op"], "recompute mode"),
        "comm_sms": _int_list("comm_sms", comm_sms, 0), "dp_shard": _int_list("dp_shard", dp_shard, 0),
        "reduce_every": _str_list("reduce_every", reduce_every, ["microbatch", "step"], "reduction"),
        "schedules": _str_list("schedules", schedules, _piper.schedule_names(), "schedule family"),
        "max_virtual": max_virtual,
        "memory_cap_bytes": (memory_cap_gib or 0) * gib,
        "memory_reserve_bytes": -1.0 if memory_reserve_gib is None else memory_reserve_gib * gib,
        "top": top, "placement_search": bool(placement_search), "show": show, "jobs": jobs,
        "budget_s": budget_s or 0.0, "calibration": "",
    }
    flags = {"model": "model", "cluster": "cluster", "devices": "devices", "pp": "pp", "dp": "dp", "ep": "ep",
             "tp": "tp", "etp": "etp", "zero": "zero", "schedules": "schedules", "memory-cap": "memory_cap_gib",
             "memory-reserve-gib": "memory_reserve_gib", "global-batch": "global_batch", "seq-len": "seq_len",
             "micro-batch-size": "micro_batch_size", "comm-sms": "comm_sms", "dp-shard": "dp_shard",
             "recompute": "recompute", "reduce-every": "reduce_every", "max-virtual": "max_virtual",
             "sequence-parallel": "sequence_parallel", "top": "top", "show": "show", "budget-s": "budget_s",
             "no-placement-search": "placement_search=False", "output": "output", "jobs": "jobs"}
    with _tempfile.TemporaryDirectory(prefix="piper-tune-") as tmp:
        args["output"] = _os.fspath(output) if output is not None else _os.path.join(tmp, "tune.csv")
        out = _native(_piper.tune, args, flags=flags, files={"model": model})
    columns = list(_piper.tune_columns())
    ranked, fields = [], []
    # The first `show` are exact (branch and bound keeps them); below them plans were left unsimulated.
    for i, r in enumerate(out.pop("ranked")[:show]):
        rec = {"rank": i + 1}
        rec.update({c: _typed(c, f) for c, f in zip(columns, r["fields"])})
        rec["strategy"] = r["strategy"]
        ranked.append(rec)
        fields.append(r["fields"])
    result = TuneResult(out)
    result["ranked"] = ranked
    result._fields = fields
    return result


@_keywords
def models() -> list:
    """The built-in model zoo, as ``piper models`` lists it: ``[{name, params, layers, hidden, experts, top_k}]``."""
    return _native(_piper.models)


@_keywords
def schedule_show(name: str, *, ranks: int = 4, microbatches: int = 8, virtual: int = 1,
                  costs=(1, 2, 1)) -> dict:
    """Unit-time view of a schedule family: the text ``piper schedule show`` prints, ``step_time`` and per-rank ops."""
    names = _piper.schedule_names()
    if name not in names:
        _check_choice("name", name, names, "schedule family")
    _check_int("ranks", ranks)
    _check_int("microbatches", microbatches)
    _check_int("virtual", virtual)
    costs = _int_list("costs", costs)
    if len(costs) != 3:
        _bad("costs", costs, "must be three positive integers F, B, W")
    return _native(_piper.schedule_show, name, ranks, microbatches, virtual, costs)


# ---------------------------------------------------------------------------------------------
# The piper command: run (host backend, one MPI rank per device) and PNG plots


def _cli():
    """The piper command of this build ($PIPER_CLI, else the build's, else on PATH)."""
    env = _os.environ.get("PIPER_CLI")
    if env:
        return env
    try:
        from . import _build
        if _os.access(_build.PIPER_CLI, _os.X_OK):
            return _build.PIPER_CLI
    except ImportError:
        pass
    here = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "..", "..", "bin", "piper")
    if _os.access(here, _os.X_OK):
        return _os.path.normpath(here)
    found = _shutil.which("piper")
    if not found:
        raise PiperError("cannot find the piper command: set PIPER_CLI to its path (build/bin/piper)")
    return found


def _mpiexec():
    env = _os.environ.get("PIPER_MPIEXEC")
    if env:
        return env
    try:
        from . import _build
        if _build.MPIEXEC and _os.access(_build.MPIEXEC, _os.X_OK):
            return _build.MPIEXEC
    except ImportError:
        pass
    found = _shutil.which("mpirun") or _shutil.which("mpiexec")
    if not found:
        raise PiperError("run: cannot find mpirun (install OpenMPI, or set PIPER_MPIEXEC)")
    return found


_RUN_FLAGS = {"steps": "steps", "seed": "seed", "data": "data", "lr": "lr", "adam-eps": "adam_eps",
              "save": "save", "save-every": "save_every", "resume": "resume", "dump-params": "dump_params",
              "calibrate": "calibrate", "stall-timeout": "stall_timeout", "trace": "trace", "plan": "plan",
              "model": "scenario['model']"}


def _cli_error(stderr, flags, files=None):
    """The one line after "piper: error: " (with keyword names for the flags, and `files`' keyword
    before a message that starts with its file name), else stderr's last line."""
    message = _cli_line(stderr, flags)
    for kw, path in (files or {}).items():
        if path and message.startswith(f"{path}: "):
            return f"{kw}={path!r}: " + message[len(path) + 2:]
    return message


def _cli_line(stderr, flags):
    """The message of the CLI's "piper: error: " line, its flags named as keywords."""
    lines = [l for l in stderr.splitlines() if l.strip()]
    for l in lines:
        for prefix in ("piper: error: ", "piper: internal error: "):
            if l.startswith(prefix):
                return _speak(l[len(prefix):], flags)
    return lines[-1] if lines else "no message"


def _in_train_terms(message, where, keys):
    """A CLI message about the flags of a scenario's "train" `keys` in the scenario's terms, as ``piper
    run --scenario`` words it: "--beta1 must be ..." reads "s.json: field 'train.beta1': must be ...",
    and a later mention of such a flag "'train.beta1'"."""
    flag_of = {"--" + k.replace("_", "-"): k for k in keys}
    if not flag_of:
        return message
    pattern = _re.compile(r"(?<![\w-])(" + "|".join(_re.escape(f) for f in flag_of) + r")(?![\w-])")
    head, lead = "", pattern.match(message)
    if lead:
        head = f"{where}: field 'train.{flag_of[lead.group(1)]}': "
        message = message[lead.end():].lstrip(" :")
    return head + pattern.sub(lambda m: f"'train.{flag_of[m.group(1)]}'", message)


@_keywords
def run(scenario=None, *, plan=None, steps: int | None = None, seed: int | None = None, reference: bool = False,
        lr: float | None = None, adam_eps: float | None = None, data: str | None = None, save: str | None = None,
        save_every: int | None = None, resume: str | None = None, dump_params: str | None = None,
        calibrate: str | None = None, trace: str | None = None, on_nonfinite: str | None = None,
        stall_timeout: float | None = None, base_dir: str = "", timeout: float | None = None) -> RunResult:
    """Train a scenario (dict or file) or ``plan=`` (a Program dict or file) on the host backend, as ``piper run``.

    One MPI rank per device of the plan (``mpirun -np N piper run --plan ...``), or, with
    `reference`, the single-process reference on the same global batch. Returns a :class:`RunResult`
    (run.json: ``losses``, ``step_times_s``, ``step_time_s``, ``tokens_per_s``, ...) whose
    to_records() has one row per step. A scenario's ``"train"`` section applies as with ``piper run
    --scenario``: each setting a keyword here does not give (steps 3 and seed 1 where neither does).
    Raises :class:`InputError` for a bad input, :class:`RunError` when a rank failed or stalled,
    ``TimeoutError`` after `timeout` seconds.
    """
    if (scenario is None) == (plan is None):
        raise InputError("run: give a scenario or plan=, not both or neither")
    if steps is not None:
        _check_int("steps", steps)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        _bad("seed", seed, "must be an integer >= 0")
    if on_nonfinite is not None:
        _check_choice("on_nonfinite", on_nonfinite, ["stop", "skip"], "value")
    if save_every is not None:
        _check_int("save_every", save_every)
        if save is None:
            raise InputError("save_every needs save= (the checkpoint file to write)")
    if reference and calibrate is not None:
        raise InputError("calibrate= measures the plan's ops: it needs a distributed run, not reference=True")
    for kw, v in (("lr", lr), ("adam_eps", adam_eps)):
        if v is not None:
            _check_number(kw, v)
    if stall_timeout is not None:
        _check_number("stall_timeout", stall_timeout, 1e-9)
    if timeout is not None:
        _check_number("timeout", timeout, positive=True)
    # The training settings: the scenario's "train" section (checked by compile), each under the flag of
    # its name (lr_decay: --lr-decay), then the keywords given.
    settings, where = {}, "scenario"
    if scenario is not None:
        program = compile(scenario, base_dir=base_dir)
        spec, spec_dir = _load(scenario, "scenario", base_dir)
        if isinstance(scenario, (str, _os.PathLike)):
            where = _os.fspath(scenario)
        for key, value in spec.get("train", {}).items():
            if key in ("data", "resume") and not _os.path.isabs(value) and spec_dir \
                    and _os.path.exists(_os.path.join(spec_dir, value)):
                value = _os.path.join(spec_dir, value)  # relative to the scenario's folder, as the CLI reads it
            settings[key] = value
    else:
        program, _ = _load(plan, "plan", base_dir)
        if not isinstance(program, dict) or not isinstance(program.get("plan_of_device"), list):
            _bad("plan", "...", "not a Program (no 'plan_of_device'; compile one with piper.compile)")
    devices = len(program["plan_of_device"])
    with _tempfile.TemporaryDirectory(prefix="piper-run-") as tmp:
        plan_path = _os.path.join(tmp, "plan.json")
        report_path = _os.path.join(tmp, "run.json")
        with open(plan_path, "w") as f:
            _json.dump(program, f)
        cmd = [_cli(), "run", "--plan", plan_path, "--report", report_path]
        given = {"steps": steps, "seed": seed, "lr": lr, "adam_eps": adam_eps, "data": data, "save": save,
                 "save_every": save_every, "resume": resume, "dump_params": dump_params, "calibrate": calibrate,
                 "trace": trace, "on_nonfinite": on_nonfinite, "stall_timeout": stall_timeout}
        given = {k: v for k, v in given.items() if v is not None}
        from_scenario = [k for k in settings if k not in given]  # named as the scenario's fields, not as flags
        settings.update(given)
        for key, v in settings.items():
            cmd += ["--" + key.replace("_", "-"), str(_os.fspath(v)) if isinstance(v, _os.PathLike) else str(v)]
        if reference:
            cmd.append("--reference")
        else:
            mpi = [_mpiexec()]
            if hasattr(_os, "geteuid") and _os.geteuid() == 0:
                mpi.append("--allow-run-as-root")  # OpenMPI refuses root without it
            cmd = mpi + ["--oversubscribe", "-np", str(devices)] + cmd
        try:
            p = _subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except _subprocess.TimeoutExpired:
            raise TimeoutError(f"run: not finished after timeout={timeout} seconds") from None
        if p.returncode != 0:
            flags = {f: kw for f, kw in _RUN_FLAGS.items() if kw not in from_scenario}
            msg = _cli_error(p.stderr, flags, {"resume": resume, "data": data, "save": save,
                                               "dump_params": dump_params, "calibrate": calibrate, "trace": trace})
            msg = _in_train_terms(msg, where, from_scenario)
            # The plan went through a temporary file: name what the caller gave instead.
            given = _os.fspath(plan) if isinstance(plan, (str, _os.PathLike)) else "plan"
            # The CLI's own messages about a plan start "plan: field ...": a plan given by value is
            # already named by that prefix (it read "plan: plan: field ...").
            if given == "plan":
                msg = msg.replace(plan_path + ": plan: ", "plan: ")
            msg = msg.replace(plan_path, given)
            if p.returncode == 2:
                raise InputError(msg)
            if p.returncode == 3:
                raise InternalError(msg)
            raise RunError(f"{msg} (exit status {p.returncode})")
        with open(report_path) as f:
            return RunResult(_json.load(f))


@_keywords
def plot(csv: str, *, x: str, y: str, output: str, series: str | None = None, where: dict | None = None,
         line: bool = False, log_x: bool = False, log_y: bool = False, title: str = "", x_label: str = "",
         y_label: str = "") -> dict:
    """Draw two columns of a results CSV (a sweep's or tune's, or any CSV with a header), as ``piper plot``.

    Columns are named (`x`, `y`, `series` splits the rows into one series per value, `where` keeps
    rows whose columns equal the given values, e.g. ``{"status": "ok"}``). Rows without numbers in
    both columns (blank figures of invalid rows) are skipped, never drawn as 0. `output` ending in
    ``.svg`` is written by this module (no Qt needed); ``.png`` by ``piper plot``. Returns
    ``{"points", "series", "skipped", "output"}``.
    """
    from . import _svg

    csv_path = _os.fspath(csv)
    output = _os.fspath(output)
    ext = _os.path.splitext(output)[1].lower()
    if ext not in (".svg", ".png"):
        _bad("output", output, "expected a .svg or .png file name")
    if where is not None and not isinstance(where, dict):
        _bad("where", where, "must be a dict {column: value}")
    rows = _csv_rows(csv_path)
    if not rows:
        raise InputError(f"{csv_path}: empty file (expected a header line)")
    header = rows[0]

    def column(keyword, name):
        if name not in header:
            raise InputError(f"{keyword}={name!r}: no such column in {csv_path}{_did_you_mean(name, header)}; "
                             f"columns: {', '.join(header)}")
        return header.index(name)

    xi, yi = column("x", x), column("y", y)
    si = column("series", series) if series is not None else None
    wanted = [(column("where", k), str(v).lower() if isinstance(v, bool) else str(v)) for k, v in (where or {}).items()]
    groups, skipped = {}, 0
    for n, fields in enumerate(rows[1:], start=2):
        if not fields:
            continue
        if len(fields) != len(header):
            raise InputError(f"{csv_path}: line {n}: {len(fields)} fields, the header has {len(header)}")
        if any(fields[i] != v for i, v in wanted):
            continue
        try:
            px, py = _number(float, fields[xi]), _number(float, fields[yi])
        except ValueError:
            skipped += 1
            continue
        if px != px or py != py or px in (float("inf"), float("-inf")) or py in (float("inf"), float("-inf")):
            skipped += 1
            continue
        name = fields[si] if si is not None else ""
        groups.setdefault(name, ([], []))
        groups[name][0].append(px)
        groups[name][1].append(py)
    points = sum(len(v[0]) for v in groups.values())
    if points == 0:
        raise InputError(f"{csv_path}: no row has numbers in both {x!r} and {y!r}")
    if ext == ".png":
        cmd = [_cli(), "plot", csv_path, "--x", x, "--y", y, "-o", output]
        if series is not None:
            cmd += ["--series", series]
        if len(wanted) > 1:
            raise InputError("where: piper plot's PNG takes one column=value; give one, or write .svg")
        for k, v in (where or {}).items():
            cmd += ["--where", f"{k}={v}"]
        for flag, v in (("--line", line), ("--log-x", log_x), ("--log-y", log_y)):
            if v:
                cmd.append(flag)
        for flag, v in (("--title", title), ("--x-label", x_label), ("--y-label", y_label)):
            if v:
                cmd += [flag, v]
        p = _subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            raise InputError(_cli_error(p.stderr, {"x": "x", "y": "y", "series": "series", "where": "where",
                                                   "output": "output"}))
    else:
        chart = [(f"{series} = {name}" if series is not None else "", xs, ys) for name, (xs, ys) in groups.items()]
        try:
            _svg.write(output, chart, title=title, x_label=x_label or x, y_label=y_label or y, line=line,
                       log_x=log_x, log_y=log_y)
        except ValueError as e:
            raise InputError(f"log_x={log_x}, log_y={log_y}: {e}") from None
        except OSError as e:
            raise InputError(f"output={output!r}: cannot write: {(e.strerror or str(e)).lower()}") from None
    return {"points": points, "series": len(groups), "skipped": skipped, "output": output}
