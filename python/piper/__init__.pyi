# Type stubs of the piper package (python/piper/__init__.py); tests/python/test_api.py checks that
# every function here has the runtime's parameters, kinds and defaults.
import os
from typing import Any, Iterable, Sequence

__version__: str

class PiperError(Exception): ...
class InputError(PiperError, ValueError): ...
class InternalError(PiperError, RuntimeError): ...
class RunError(PiperError, RuntimeError): ...

Error = InputError

Scenario = dict[str, Any] | str | os.PathLike[str]
Program = dict[str, Any] | str | os.PathLike[str]
Record = dict[str, Any]
IntOrInts = int | Sequence[int]
StrOrStrs = str | Sequence[str]

class _Table:
    def columns(self) -> list[str]: ...
    def to_records(self) -> list[Record]: ...
    def to_dataframe(self) -> Any: ...

class Report(_Table, dict[str, Any]): ...
class SweepResult(_Table, dict[str, Any]): ...
class RunResult(_Table, dict[str, Any]): ...

class Results(_Table, list[Record]):
    def __init__(self, records: Iterable[Record] = (), columns: Iterable[str] = ()) -> None: ...

class TuneResult(_Table, dict[str, Any]):
    def directives(self, rank: int = 1) -> list[Any]: ...
    def scenario(self, rank: int = 1) -> dict[str, Any]: ...

def compile(scenario: Scenario, *, base_dir: str = "") -> dict[str, Any]: ...
def directives(scenario: Scenario, *, base_dir: str = "") -> list[Any]: ...
def simulate(
    scenario: Scenario | None = None,
    *,
    plan: Program | None = None,
    cluster: str = "",
    engine: str = "",
    calibration: str = "",
    runtime: str = "",
    attention_kernel: str = "",
    base_dir: str = "",
) -> Report: ...
def verify(plan: Program) -> list[dict[str, str]]: ...
def sweep(
    spec: dict[str, Any] | str | os.PathLike[str],
    *,
    output: str | None = None,
    jobs: int = 1,
    base_dir: str = "",
) -> SweepResult: ...
def tune(
    model: str,
    *,
    devices: int,
    cluster: str = "dgx-h200",
    global_batch: int | None = None,
    seq_len: int | None = None,
    micro_batch_size: IntOrInts = (1, 2),
    zero: IntOrInts = (0, 1, 2, 3),
    pp: IntOrInts | None = None,
    dp: IntOrInts | None = None,
    ep: IntOrInts | None = None,
    tp: IntOrInts | None = None,
    etp: IntOrInts | None = None,
    sequence_parallel: str | bool = "both",
    recompute: StrOrStrs = ("none", "selective", "full"),
    comm_sms: IntOrInts | None = None,
    dp_shard: IntOrInts | None = None,
    reduce_every: StrOrStrs | None = None,
    schedules: StrOrStrs | None = None,
    max_virtual: int = 4,
    memory_cap_gib: float | None = None,
    memory_reserve_gib: float | None = None,
    budget_s: float | None = None,
    top: int = 3,
    placement_search: bool = True,
    show: int = 10,
    jobs: int | None = None,
    output: str | None = None,
    runtime: str = "",
    attention_kernel: str = "",
) -> TuneResult: ...
def read_results(csv: str | os.PathLike[str]) -> Results: ...
def models() -> list[dict[str, Any]]: ...
def schedule_show(
    name: str,
    *,
    ranks: int = 4,
    microbatches: int = 8,
    virtual: int = 1,
    costs: Sequence[int] = (1, 2, 1),
) -> dict[str, Any]: ...
def run(
    scenario: Scenario | None = None,
    *,
    plan: Program | None = None,
    steps: int | None = None,
    seed: int | None = None,
    reference: bool = False,
    lr: float | None = None,
    adam_eps: float | None = None,
    data: str | None = None,
    save: str | None = None,
    save_every: int | None = None,
    resume: str | None = None,
    dump_params: str | None = None,
    calibrate: str | None = None,
    trace: str | None = None,
    on_nonfinite: str | None = None,
    stall_timeout: float | None = None,
    base_dir: str = "",
    timeout: float | None = None,
) -> RunResult: ...
def plot(
    csv: str | os.PathLike[str],
    *,
    x: str,
    y: str,
    output: str | os.PathLike[str],
    series: str | None = None,
    where: dict[str, Any] | None = None,
    line: bool = False,
    log_x: bool = False,
    log_y: bool = False,
    title: str = "",
    x_label: str = "",
    y_label: str = "",
) -> dict[str, Any]: ...
def strategy_settings() -> list[dict[str, Any]]: ...
# Keyword-only, one per setting of the settings table (core/include/piper/core/strategy_settings.def),
# with its default; tests/python/test_api.py checks the runtime signature against the table.
def strategy(**settings: Any) -> dict[str, Any]: ...
