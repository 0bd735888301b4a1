"""The piper package's Python surface: signatures and stubs, exceptions that name keywords, table
forms against the CLI's CSV files, and tune, run and plot against `piper tune`, `piper run` and
`piper plot`."""
import ast
import csv
import importlib
import inspect
import json
import os
import py_compile
import re
import subprocess
import tempfile
import unittest
import xml.etree.ElementTree as ET

import piper

SOURCE_DIR = os.environ["PIPER_SOURCE_DIR"]
CLI = os.environ["PIPER_CLI"]
MPIEXEC = os.environ.get("PIPER_MPIEXEC", "mpirun")
TINY = os.path.join(SOURCE_DIR, "tests", "data", "runtime-tiny-gpt.json")
PACKAGE_DIR = os.path.dirname(piper.__file__)
FUNCTIONS = ["compile", "directives", "simulate", "verify", "sweep", "tune", "run", "plot", "read_results", "models", "schedule_show",
             "strategy", "strategy_settings"]
# Wall-clock fields of a results row: two processes never measure the same.
TIMES = ("compile_time_s", "simulate_time_s")


def run_cli(*args, check=True, cwd=SOURCE_DIR):
    return subprocess.run([CLI, *args], cwd=cwd, capture_output=True, text=True, check=check)


def read_csv(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], [dict(zip(rows[0], r)) for r in rows[1:]]


def assertSameField(test, value, text, msg):
    """A typed record value against the CLI's CSV text: blank is None, 0/1 are bools, numbers equal."""
    if value is None:
        test.assertEqual(text, "", msg)
    elif isinstance(value, bool):
        test.assertEqual(text, "1" if value else "0", msg)
    elif isinstance(value, (int, float)):
        test.assertEqual(value, float(text), msg)
        if msg.endswith("_bytes") or msg.split()[-1] in ("pp", "dp", "ep", "tp", "devices", "microbatches"):
            test.assertIsInstance(value, int, msg)
    else:
        test.assertEqual(value, text, msg)


class Signatures(unittest.TestCase):
    def test_every_function_has_a_python_signature(self):
        for name in FUNCTIONS:
            fn = getattr(piper, name)
            sig = inspect.signature(fn)  # raised ValueError for the pybind11 builtins
            self.assertTrue(fn.__doc__ and fn.__doc__.strip(), name)
            for p in sig.parameters.values():
                self.assertNotIn(p.kind, (p.VAR_POSITIONAL, p.VAR_KEYWORD), f"{name}({p.name})")

    def test_options_are_keyword_only(self):
        sig = inspect.signature(piper.simulate)
        self.assertEqual([p.name for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY],
                         ["plan", "cluster", "engine", "calibration", "runtime", "attention_kernel", "base_dir"])
        tune = inspect.signature(piper.tune).parameters
        self.assertIs(tune["model"].kind, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        self.assertIs(tune["devices"].kind, inspect.Parameter.KEYWORD_ONLY)
        self.assertIs(tune["devices"].default, inspect.Parameter.empty)  # required, as --devices
        for pin in ("pp", "dp", "ep", "tp"):
            self.assertIsNone(tune[pin].default, pin)
        with self.assertRaises(TypeError):
            piper.simulate({"model": "qwen3-9m"}, None, "dgx-h200")  # options are not positional

    def test_version(self):
        self.assertEqual(run_cli("--version").stdout, f"piper {piper.__version__}\n")


class Stubs(unittest.TestCase):
    """__init__.pyi parses and has every runtime function with the same parameters, kinds and defaults."""

    @classmethod
    def setUpClass(cls):
        cls.path = os.path.join(PACKAGE_DIR, "__init__.pyi")
        with open(cls.path) as f:
            cls.tree = ast.parse(f.read(), cls.path)
        cls.stubs = {n.name: n for n in cls.tree.body if isinstance(n, ast.FunctionDef)}

    def test_compiles_and_py_typed_is_installed(self):
        with tempfile.TemporaryDirectory() as tmp:
            py_compile.compile(self.path, cfile=os.path.join(tmp, "stub.pyc"), doraise=True)
        self.assertTrue(os.path.isfile(os.path.join(PACKAGE_DIR, "py.typed")))

    def test_every_public_function_has_a_stub(self):
        public = {n for n in piper.__all__ if inspect.isfunction(getattr(piper, n))}
        self.assertEqual(public, set(FUNCTIONS))
        self.assertEqual(set(self.stubs), public)
        classes = {n.name for n in self.tree.body if isinstance(n, ast.ClassDef)}
        for n in piper.__all__:
            if inspect.isclass(getattr(piper, n)) and getattr(piper, n).__name__ == n:
                self.assertIn(n, classes)

    def test_stub_signatures_match_the_runtime(self):
        functions = [(name, node, getattr(piper, name)) for name, node in self.stubs.items()]
        # Methods too (TuneResult.directives, Results.__init__, ...), without self.
        for cls in (n for n in self.tree.body if isinstance(n, ast.ClassDef) and hasattr(piper, n.name)):
            for node in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
                runtime_cls = getattr(piper, cls.name)
                self.assertIn(node.name, vars(runtime_cls) if node.name == "__init__" else dir(runtime_cls),
                              f"{cls.name}.{node.name}")
                node.args.args = node.args.args[1:]
                functions.append((f"{cls.name}.{node.name}", node, getattr(runtime_cls, node.name)))
        self.assertIn("TuneResult.directives", [f[0] for f in functions])
        for name, node, fn in functions:
            runtime = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
            if name == "strategy":
                # One keyword per setting of the table, so the stub takes **settings and the runtime
                # signature is the table's: names, keyword-only, defaults.
                self.assertEqual((node.args.args, node.args.kwonlyargs, node.args.kwarg.arg), ([], [], "settings"))
                table = piper.strategy_settings()
                self.assertEqual([(p.name, p.kind, p.default) for p in runtime],
                                 [(s["name"], inspect.Parameter.KEYWORD_ONLY, s["default"]) for s in table])
                continue
            a = node.args
            stub = [(x.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD) for x in a.args] + \
                   [(x.arg, inspect.Parameter.KEYWORD_ONLY) for x in a.kwonlyargs]
            self.assertEqual(stub, [(p.name, p.kind) for p in runtime], name)
            defaults = [None] * (len(a.args) - len(a.defaults)) + list(a.defaults) + list(a.kw_defaults)
            for p, d in zip(runtime, defaults):
                if p.default is inspect.Parameter.empty:
                    self.assertIsNone(d, f"{name}({p.name}) has no default")
                else:
                    self.assertIsNotNone(d, f"{name}({p.name}) needs a default in the stub")
                    self.assertEqual(ast.literal_eval(d), p.default, f"{name}({p.name})")


class Strategy(unittest.TestCase):
    """piper.strategy(**settings): the keywords are the settings table's, checked as a scenario's keys."""

    @staticmethod
    def other_value(setting):
        d = setting["default"]
        if setting["type"] == "bool":
            return not d
        if setting["type"] == "int":
            return setting["min"] if d != setting["min"] else setting["min"] + 1
        if setting["type"] == "double":
            return 25.5
        if "choices" not in setting:  # a free-form string (zb_memory_limit): any other text
            return d + "-other"
        return setting["choices"][-1]

    def test_every_setting_round_trips_by_keyword_and_csv_type(self):
        table = piper.strategy_settings()
        defaults = piper.strategy()
        self.assertEqual(list(defaults), sorted(s["name"] for s in table))
        for s in table:
            v = self.other_value(s)
            got = piper.strategy(**{s["name"]: v})
            self.assertEqual(got, {**defaults, s["name"]: v}, s["name"])
            # A results CSV column of that name reads back as the same value.
            text = ("1" if v else "0") if isinstance(v, bool) else str(v)
            self.assertEqual(piper._typed(s["name"], text), v, s["name"])
            self.assertIs(type(piper._typed(s["name"], text)), type(v), s["name"])

    def test_unknown_keyword_is_an_input_error_with_a_suggestion(self):
        with self.assertRaises(piper.InputError) as e:
            piper.strategy(microbatchs=4)
        self.assertIn("'microbatchs'", str(e.exception))
        self.assertIn("did you mean 'microbatches'?", str(e.exception))

    def test_bad_enum_value_names_the_keyword(self):
        with self.assertRaises(piper.InputError) as e:
            piper.strategy(recompute="ful")
        self.assertIn("'recompute'", str(e.exception))
        self.assertIn("did you mean 'full'?", str(e.exception))
        with self.assertRaises(piper.InputError) as e:
            piper.strategy(zero=4)
        self.assertIn("'zero'", str(e.exception))


class Errors(unittest.TestCase):
    SCENARIO = {"model": "qwen3-9m", "strategy": {"pp": 2, "microbatches": 2}}

    def test_hierarchy(self):
        self.assertTrue(issubclass(piper.InputError, piper.PiperError))
        self.assertTrue(issubclass(piper.InputError, ValueError))
        self.assertTrue(issubclass(piper.InternalError, piper.PiperError))
        self.assertTrue(issubclass(piper.RunError, piper.PiperError))
        self.assertFalse(issubclass(piper.InternalError, ValueError))
        self.assertIs(piper.Error, piper.InputError)

    def test_engine_names_the_keyword_with_a_suggestion(self):
        with self.assertRaises(piper.InputError) as ctx:
            piper.simulate(self.SCENARIO, engine="analytc")
        msg = str(ctx.exception)
        self.assertTrue(msg.startswith("engine='analytc': unknown engine (did you mean 'analytic'?)"), msg)
        self.assertNotIn("--", msg)
        # The CLI says the same of its flag.
        cli = run_cli("simulate", "--model", "qwen3-9m", "--engine", "analytc", check=False)
        self.assertIn("--engine 'analytc'", cli.stderr)

    def test_engine_in_the_scenario_names_the_field(self):
        with self.assertRaisesRegex(piper.InputError, r"^scenario\['engine'\]='simgird': unknown engine "
                                                      r"\(did you mean 'simgrid'\?\)"):
            piper.simulate(dict(self.SCENARIO, engine="simgird"))

    def test_cluster_names_the_keyword(self):
        with self.assertRaisesRegex(piper.InputError, r"^cluster='dgx-h20': neither a preset nor a file "
                                                      r"\(did you mean 'dgx-h200'\?\)"):
            piper.simulate(self.SCENARIO, cluster="dgx-h20")
        with self.assertRaisesRegex(piper.InputError, r"^scenario\['cluster'\]='dgx-h20': neither a preset nor a file "
                                                      r"\(did you mean 'dgx-h200'\?\)"):
            piper.simulate(dict(self.SCENARIO, cluster="dgx-h20"))
        with self.assertRaisesRegex(piper.InputError, r"^cluster='dgx-h10': .*did you mean 'dgx-h100'"):
            piper.tune("qwen3-9m", devices=2, cluster="dgx-h10")

    def test_file_keyword_is_named(self):
        with self.assertRaisesRegex(piper.InputError, r"^calibration='no-such-file.json': cannot open"):
            piper.simulate(self.SCENARIO, calibration="no-such-file.json")

    def test_unknown_keyword_is_a_type_error_with_a_suggestion(self):
        with self.assertRaisesRegex(TypeError, r"^simulate\(\) got an unexpected keyword argument 'engin' "
                                               r"\(did you mean 'engine'\?\)$"):
            piper.simulate(self.SCENARIO, engin="analytic")
        with self.assertRaisesRegex(TypeError, r"^tune\(\) got an unexpected keyword argument 'device' "
                                               r"\(did you mean 'devices'\?\)$"):
            piper.tune("qwen3-9m", device=8)
        with self.assertRaisesRegex(TypeError, r"unexpected keyword argument 'zzz'$"):
            piper.sweep({}, zzz=1)

    def test_values_name_the_keyword(self):
        cases = [
            (lambda: piper.tune("qwen3-9m", devices=0), r"^devices=0: must be an integer >= 1$"),
            (lambda: piper.tune("qwen3-9m", devices=2, schedules=["1f1b", "gpipee"]),
             r"^schedules=\['1f1b', 'gpipee'\]: unknown schedule family 'gpipee' \(did you mean 'gpipe'\?\)"),
            (lambda: piper.tune("qwen3-9m", devices=2, zero=4), r"^zero=4: every value must be an integer from 0 to 3"),
            (lambda: piper.tune("qwen3-9m", devices=2, memory_cap_gib=10, memory_reserve_gib=1),
             r"^memory_cap_gib and memory_reserve_gib: give one"),
            # Checked by the library (search::run_tune), which names --pp / --model: in Python, the keyword.
            (lambda: piper.tune("qwen3-9m", devices=8, pp=[2, 3]), r"^pp=3: does not divide the 8 devices$"),
            (lambda: piper.tune("qwen3-9", devices=2),
             r"^model='qwen3-9': neither a zoo model \(.*\) nor a readable file \(did you mean 'qwen3-9m'\?\)$"),
            (lambda: piper.simulate({"model": "llama3-7b"}), r"^scenario\['model'\]='llama3-7b': neither a zoo model"),
            (lambda: piper.sweep({"model": "qwen3-9m"}, jobs=0), r"^jobs=0: must be an integer >= 1$"),
            (lambda: piper.schedule_show("1f1bb"), r"^name='1f1bb': unknown schedule family \(did you mean '1f1b'\?\)"),
            (lambda: piper.run(self.SCENARIO, steps=0), r"^steps=0: must be an integer >= 1$"),
            (lambda: piper.run(self.SCENARIO, on_nonfinite="skipp"), r"^on_nonfinite='skipp': .*did you mean 'skip'"),
        ]
        for fn, pattern in cases:
            with self.assertRaisesRegex(piper.InputError, pattern):
                fn()

    def test_internal_errors_say_so(self):
        def bug():
            raise piper._piper.NativeInternalError("vector::_M_range_check")
        with self.assertRaisesRegex(piper.InternalError, r"^vector::_M_range_check \(please report this: it is a bug "
                                                         r"in piper, not in the input\)$"):
            piper._native(bug)

    def test_library_errors_pass_through_as_input_errors(self):
        with self.assertRaisesRegex(piper.InputError, r"^scenario: field 'strategy.microbatchs': unknown field "
                                                      r"\(did you mean 'microbatches'\?\)$"):
            piper.simulate({"model": "qwen3-9m", "strategy": {"microbatchs": 4}})


class Files(unittest.TestCase):
    def test_scenario_and_plan_files(self):
        # A scenario file whose model is a file beside it: relative names resolve against its folder.
        with tempfile.TemporaryDirectory() as tmp:
            with open(TINY) as f, open(os.path.join(tmp, "tiny.json"), "w") as g:
                g.write(f.read())
            scenario = {"model": "tiny.json", "strategy": {"pp": 2, "microbatches": 2}}
            path = os.path.join(tmp, "scenario.json")
            with open(path, "w") as f:
                json.dump(scenario, f)
            by_file = piper.simulate(path, engine="analytic")
            by_dict = piper.simulate(scenario, engine="analytic", base_dir=tmp)
            self.assertEqual(by_file["step_time_s"], by_dict["step_time_s"])
            plan_path = os.path.join(tmp, "plan.json")
            with open(plan_path, "w") as f:
                json.dump(piper.compile(path), f)
            self.assertEqual(piper.verify(plan_path), [])
            self.assertEqual(piper.simulate(plan=plan_path, engine="analytic")["step_time_s"], by_file["step_time_s"])
        with self.assertRaisesRegex(piper.InputError, r"^scenario='/no/such.json': cannot open"):
            piper.simulate("/no/such.json")


class Runtime(unittest.TestCase):
    SCENARIO = {"model": "qwen3-9m", "strategy": {"pp": 2, "microbatches": 4}}

    def test_runtime_and_attention_kernel_cost_as_a_cluster_file_says(self):
        # The same prediction as the settings spelled out in a cluster file, as the CLI's flags give.
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "c.json")
            with open(path, "w") as f:
                json.dump({"preset": "dgx-h100", "runtime": "eager", "attention_kernel": "fa2"}, f)
            spelled = piper.simulate(self.SCENARIO, cluster=path, engine="analytic")
            named = piper.simulate(self.SCENARIO, cluster="dgx-h100", engine="analytic", runtime="eager",
                                   attention_kernel="fa2")
            self.assertEqual(named["step_time_s"], spelled["step_time_s"])
            self.assertEqual(named["runtime"], "runtime eager, attention fa2")
            fused = piper.simulate(self.SCENARIO, cluster="dgx-h100", engine="analytic")
            self.assertLess(fused["step_time_s"], named["step_time_s"])
            self.assertEqual(fused["runtime"], "")
            # Over a scenario's own cluster, a file relative to base_dir.
            own = dict(self.SCENARIO, cluster="c.json")
            self.assertEqual(piper.simulate(own, engine="analytic", base_dir=tmp, runtime="eager")["step_time_s"],
                             spelled["step_time_s"])
        cli = run_cli("simulate", "--model", "qwen3-9m", "--pp", "2", "--microbatches", "4", "--engine", "analytic",
                      "--cluster", "dgx-h100", "--runtime", "eager", "--attention-kernel", "fa2").stdout
        self.assertIn(f"step time             {named['step_time_s'] * 1e3:.3f} ms", cli)

    def test_errors_name_the_keyword(self):
        with self.assertRaisesRegex(piper.InputError, r"^runtime='eagr': unknown runtime profile \(did you mean 'eager'\?\)"):
            piper.simulate(self.SCENARIO, engine="analytic", runtime="eagr")
        with self.assertRaisesRegex(piper.InputError, r"^attention_kernel='fa3': kernel table 'a100-80gb-sxm' has no "
                                                      r"attention kernel 'fa3' \(it has: fa1, fa2\)$"):
            piper.simulate(self.SCENARIO, cluster="dgx-a100-80g", engine="analytic", attention_kernel="fa3")
        with self.assertRaisesRegex(piper.InputError, r"^runtime='lazy'"):
            piper.tune("qwen3-9m", devices=2, runtime="lazy")


    def test_inline_cluster_specs_are_taken_as_the_cli_takes_them(self):
        # Probe 15: an inline spec was "neither a preset nor a file" to Python, as cluster=, as a
        # scenario's "cluster" (what --runtime --save-scenario writes, and what tune's scenarios hold).
        spec = '{"cluster": "dgx-h100", "runtime": "eager"}'
        named = piper.simulate(self.SCENARIO, cluster="dgx-h100", engine="analytic", runtime="eager")
        self.assertEqual(piper.simulate(self.SCENARIO, cluster=spec, engine="analytic")["step_time_s"],
                         named["step_time_s"])
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "s.json")
            run_cli("simulate", "--model", "qwen3-9m", "--pp", "2", "--microbatches", "4", "--engine", "analytic",
                    "--cluster", "dgx-h100", "--runtime", "eager", "--save-scenario", path)
            self.assertEqual(piper.simulate(path, engine="analytic")["step_time_s"], named["step_time_s"])
        # A tune with runtime= returns scenarios whose cluster is such a spec: each simulates as tuned.
        tuned = piper.tune("qwen3-9m", devices=1, cluster="dgx-h100", runtime="eager").scenario(rank=1)
        self.assertEqual(tuned["cluster"], '{"cluster":"dgx-h100","runtime":"eager"}')
        self.assertEqual(piper.simulate(tuned, engine="analytic")["step_time_s"],
                         piper.simulate(dict(tuned, cluster="dgx-h100"), engine="analytic",
                                        runtime="eager")["step_time_s"])
        with self.assertRaisesRegex(piper.InputError, r"^cluster='\{\"cluster\": \"nosuch\"\}': field 'cluster': "
                                                      r"'nosuch': neither a preset"):
            piper.simulate(self.SCENARIO, cluster='{"cluster": "nosuch"}', engine="analytic")
        # compile checks a scenario's cluster and engine as simulate does (probe 15: taken silently).
        with self.assertRaisesRegex(piper.InputError, r"^scenario\['engine'\]='analytc': unknown engine"):
            piper.compile(dict(self.SCENARIO, engine="analytc"))
        with self.assertRaisesRegex(piper.InputError, r"^scenario\['cluster'\]='nosuch': neither a preset nor a file"):
            piper.compile(dict(self.SCENARIO, cluster="nosuch"))


class HostileArguments(unittest.TestCase):
    """Probe 6 (docs/reliability.md, sixth probe): each of these crashed, ran away, named nothing or
    was silently taken before; now each is one line naming the keyword, field or file."""

    S = {"model": "qwen3-9m", "strategy": {"pp": 2, "microbatches": 4}}

    def test_json_files_are_read_as_the_cli_reads_them(self):
        with tempfile.TemporaryDirectory() as tmp:
            dup = os.path.join(tmp, "dup.json")
            with open(dup, "w") as f:
                f.write('{"model": "qwen3-9m", "strategy": {"pp": 2, "pp": 4}}')
            # json.loads kept pp 4 silently; the CLI refuses a key given twice.
            for fn in (piper.compile, piper.simulate, piper.directives):
                with self.assertRaisesRegex(piper.InputError, r"^" + re.escape(dup) + r": duplicate key 'pp'"):
                    fn(dup)
            with self.assertRaisesRegex(piper.InputError, r"^" + re.escape(dup) + r": duplicate key 'pp'"):
                piper.sweep(dup)
            deep = os.path.join(tmp, "deep.json")
            with open(deep, "w") as f:
                f.write("[" * 100000 + "]" * 100000)
            with self.assertRaisesRegex(piper.InputError, r"limit 'json-depth'"):
                piper.verify(deep)
            text = os.path.join(tmp, "x.csv")
            with open(text, "w") as f:
                f.write("a,b\n")
            with self.assertRaisesRegex(piper.InputError, r"^" + re.escape(text) + r": not JSON: "):
                piper.verify(text)
        # open().read() of /dev/zero ran the process out of memory: now the input-bytes limit.
        with self.assertRaisesRegex(piper.InputError, r"^/dev/zero: .* exceeds the limit .*'input-bytes'"):
            piper.compile("/dev/zero")
        with self.assertRaisesRegex(piper.InputError, r"^scenario='/no/such.json': cannot open"):
            piper.compile("/no/such.json")

    def test_dicts_that_are_not_json_name_the_field(self):
        cases = [
            ({"model": "qwen3-9m", "seq_len": float("nan")}, r"^scenario: field 'seq_len': nan is not a JSON number"),
            ({"model": "qwen3-9m", "strategy": {"bucket_mb": float("inf")}},
             r"^scenario: field 'strategy.bucket_mb': inf is not a JSON number"),
            ({"model": "qwen3-9m", "strategy": {1: 2}}, r"^scenario: field 'strategy': key 1 is not a str \(int\)$"),
            ({"model": b"qwen3-9m"}, r"^scenario: field 'model': bytes is not a JSON type"),
            ({"model": "qwen3-9m\udcff"}, r"^scenario: field 'model': .* is not valid Unicode"),
        ]
        for scenario, pattern in cases:
            with self.assertRaisesRegex(piper.InputError, pattern):
                piper.compile(scenario)
        with self.assertRaisesRegex(piper.InputError, r"^strategy: field 'bucket_mb': nan is not a JSON number"):
            piper.strategy(bucket_mb=float("nan"))
        with self.assertRaisesRegex(piper.InputError, r"^plan: field 'plans\[0\]': set is not a JSON type"):
            piper.verify({"plans": [{1, 2}]})

    def test_wrong_types_are_one_line_type_errors(self):
        cases = [
            (lambda: piper.simulate(self.S, cluster=5), r"^simulate\(\) argument cluster=5: must be a str, not int$"),
            (lambda: piper.simulate(self.S, engine=None), r"^simulate\(\) argument engine=None: must be a str"),
            (lambda: piper.compile(self.S, base_dir=None), r"^compile\(\) argument base_dir=None: must be a str"),
            # bool("no") is True: these ran the reference and searched placements.
            (lambda: piper.tune("qwen3-9m", devices=2, placement_search="no"),
             r"^tune\(\) argument placement_search='no': must be a bool \(True or False\), not str$"),
            (lambda: piper.run(self.S, reference="no"), r"^run\(\) argument reference='no': must be a bool"),
            # str(True): a trace file named 'True'.
            (lambda: piper.run(self.S, trace=True), r"^run\(\) argument trace=True: must be a str or None, not bool$"),
            (lambda: piper.plot("r.csv", x="a", y="b", output="o.svg", title=5), r"^plot\(\) argument title=5"),
            (lambda: piper.sweep(self.S, jobs=1.5), r"^sweep\(\) argument jobs=1.5: must be an int, not float$"),
        ]
        for fn, pattern in cases:
            with self.assertRaisesRegex(TypeError, pattern):
                fn()
        piper.simulate(self.S, engine="analytic", cluster="dgx-h200")  # the right types still pass

    def test_numbers_out_of_range_name_the_keyword(self):
        cases = [
            # 2**31 and more reached pybind11: a many-line TypeError or "Unable to cast" RuntimeError.
            (lambda: piper.schedule_show("1f1b", ranks=2**31), r"^ranks=2147483648: must be an integer from 1 to 2147483647$"),
            (lambda: piper.sweep(self.S, jobs=2**40), r"^jobs=1099511627776: must be an integer from 1 to"),
            (lambda: piper.tune("qwen3-9m", devices=2, pp=2**40), r"^pp=1099511627776: every value must be an integer from 1"),
            (lambda: piper.tune("qwen3-9m", devices=2, max_virtual=2**40), r"^max_virtual=1099511627776: "),
            # 0 was silently the default cap, inf no cap at all (the CLI's --memory-cap must be positive).
            (lambda: piper.tune("qwen3-9m", devices=2, memory_cap_gib=0), r"^memory_cap_gib=0: must be a finite number > 0$"),
            (lambda: piper.tune("qwen3-9m", devices=2, memory_cap_gib=float("inf")), r"^memory_cap_gib=inf: "),
            # A negative timeout raised TimeoutError at once, nan a bare ValueError from subprocess.
            (lambda: piper.run(self.S, timeout=-1), r"^timeout=-1: must be a finite number > 0$"),
            (lambda: piper.run(self.S, timeout=float("nan")), r"^timeout=nan: must be a finite number > 0$"),
        ]
        for fn, pattern in cases:
            with self.assertRaisesRegex(piper.InputError, pattern):
                fn()

    def test_run_names_the_plan_not_its_temporary_file(self):
        # The prefix was doubled ("plan: plan: field ...") for a plan given by value.
        with self.assertRaisesRegex(piper.InputError, r"^plan: field 'format': missing$"):
            piper.run(plan={"plan_of_device": [0]}, reference=True, steps=1)
        with self.assertRaisesRegex(piper.InputError, r"^plan: field 'format': missing$"):
            piper.simulate(plan={"plan_of_device": [0]})
        with self.assertRaisesRegex(piper.InputError, r"^plan: field 'format': missing$"):
            piper.verify({"plan_of_device": [0]})


class Records(unittest.TestCase):
    def test_simulate_records_one_row_per_device(self):
        report = piper.simulate({"model": "qwen3-9m", "strategy": {"pp": 2, "dp": 2, "microbatches": 4}},
                                engine="analytic")
        self.assertIsInstance(report, dict)
        records = report.to_records()
        self.assertEqual(len(records), report["devices"])
        self.assertEqual([list(r) for r in records], [report.columns()] * len(records))
        for r, d in zip(records, report["per_device"]):
            for k, v in d.items():
                if k == "peak_bytes_by_kind":
                    for kind, b in v.items():
                        self.assertEqual(r[f"peak_{kind}_bytes"], b)
                else:
                    self.assertEqual(r[k], v)
        # No ZeRO-3 here: nothing gathered, which is None (no value), not 0.
        self.assertIsNone(records[0]["peak_gathered_parameters_bytes"])

    def test_sweep_records_are_the_cli_csv(self):
        spec = {"model": "qwen3-9m", "cluster": "dgx-h200", "engine": "analytic", "pp": [1, 2], "ep": [1, 3],
                "schedule": "1f1b", "microbatches": 2}
        with tempfile.TemporaryDirectory() as tmp:
            spec_path = os.path.join(tmp, "spec.json")
            with open(spec_path, "w") as f:
                json.dump(spec, f)
            csv_path = os.path.join(tmp, "cli.csv")
            run_cli("sweep", spec_path, "-j", "1", "-o", csv_path)
            header, rows = read_csv(csv_path)
        out = piper.sweep(spec)
        records = out.to_records()
        self.assertEqual(out.columns(), header)
        cli = {r["key"]: r for r in rows}
        self.assertEqual(sorted(r["key"] for r in records), sorted(cli))
        for r in records:
            self.assertEqual(list(r), header)
            for c in header:
                if c not in TIMES:
                    assertSameField(self, r[c], cli[r["key"]][c], f"{r['key']} {c}")
        # The invalid rows (EP 3 does not divide DP 1) have no figures: None, as the CSV's blanks.
        invalid = [r for r in records if r["status"] == "invalid"]
        self.assertEqual(len(invalid), 2)
        self.assertTrue(all(r["step_time_s"] is None and r["mfu"] is None for r in invalid))

    def test_read_results_reads_what_sweep_returned(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "rows.csv")
            out = piper.sweep({"model": "qwen3-9m", "engine": "analytic", "pp": [1, 2], "ep": [1, 3]}, output=path)
            rows = piper.read_results(path)
            header, _ = read_csv(path)
            # A file that is not piper's: columns typed by what parses; blank is None.
            other = os.path.join(tmp, "other.csv")
            with open(other, "w") as f:
                f.write("name,n,x\na,1,0.5\nb,,2e3\n")
            generic = piper.read_results(other)
            with open(other, "w") as f:
                f.write("name,n\na,1,2\n")
            with self.assertRaisesRegex(piper.InputError, r"other.csv: line 2: 3 fields, the header has 2$"):
                piper.read_results(other)
        self.assertEqual(rows.columns(), header)
        self.assertEqual(rows.to_records(), out.to_records())
        self.assertEqual(generic, [{"name": "a", "n": 1, "x": 0.5}, {"name": "b", "n": None, "x": 2000.0}])

    def test_read_results_reads_as_the_cli_reads(self):
        # Probe 15: /dev/zero ran out of memory; a non-UTF-8 file raised a bare UnicodeDecodeError; "1_000"
        # and a fullwidth digit were numbers (piper plot skips them); a byte-order mark joined the first
        # column's name; `1,"2"3` read as 23.
        with self.assertRaisesRegex(piper.InputError, r"^/dev/zero: .*exceeds the limit .*'input-bytes'"):
            piper.read_results("/dev/zero")
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "r.csv")

            def read(data):
                with open(path, "wb") as f:
                    f.write(data)
                return piper.read_results(path)

            with self.assertRaisesRegex(piper.InputError, r"r.csv: byte 6: not UTF-8 text"):
                read(b"x,y\n1,\xff\n")
            self.assertEqual(read("x,y\n1_000,1\n\uff11,2\n3,4e1\ninf,nan\n5,1e400\n".encode()),
                             [{"x": "1_000", "y": 1}, {"x": "\uff11", "y": 2}, {"x": 3, "y": 40.0},
                              {"x": "inf", "y": "nan"}, {"x": 5, "y": "1e400"}])
            self.assertEqual(read(b"\xef\xbb\xbfx,y\n1,2\n"), [{"x": 1, "y": 2}])
            with self.assertRaisesRegex(piper.InputError, r"r.csv: not a well-formed CSV"):
                read(b'x,y\n1,"2"3\n')
            with self.assertRaisesRegex(piper.InputError, r"^/dev/zero: .*exceeds the limit"):
                piper.plot("/dev/zero", x="x", y="y", output=os.path.join(tmp, "z.svg"))

    def test_dataframe(self):
        out = piper.sweep({"model": "qwen3-9m", "engine": "analytic", "pp": [1, 2]})
        try:
            import pandas  # noqa: F401
        except ImportError:
            with self.assertRaisesRegex(ImportError, r"^to_dataframe\(\) needs pandas"):
                out.to_dataframe()
            self.skipTest("pandas is not installed: checked the error only")
        df = out.to_dataframe()
        self.assertEqual(list(df.columns), out.columns())
        self.assertEqual(len(df), 2)
        self.assertEqual(sorted(df["step_time_s"]), sorted(r["step_time_s"] for r in out["rows"]))
        report = piper.simulate({"model": "qwen3-9m", "strategy": {"pp": 2}}, engine="analytic")
        frame = report.to_dataframe()
        self.assertEqual(list(frame.columns), report.columns())
        self.assertEqual(list(frame["peak_memory_bytes"]), [d["peak_memory_bytes"] for d in report["per_device"]])


class Tune(unittest.TestCase):
    """piper.tune against `piper tune` with the same (small) search."""

    FLAGS = ["--model", "qwen3-9m", "--devices", "4", "--pp", "1,2", "--tp", "1", "--zero", "0,1",
             "--micro-batch-size", "1", "--recompute", "none", "--schedules", "1f1b,gpipe", "--top", "1",
             "--show", "5", "-j", "2"]
    KWARGS = dict(devices=4, pp=[1, 2], tp=1, zero=[0, 1], micro_batch_size=1, recompute="none",
                  schedules=["1f1b", "gpipe"], top=1, show=5, jobs=2)

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.cli_csv = os.path.join(cls.tmp.name, "cli.csv")
        cls.cli = run_cli("tune", *cls.FLAGS, "-o", cls.cli_csv, check=False)
        cls.py_csv = os.path.join(cls.tmp.name, "py.csv")
        cls.result = piper.tune("qwen3-9m", output=cls.py_csv, **cls.KWARGS)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_ranked_plans_are_the_clis(self):
        self.assertEqual(self.cli.returncode, 0, self.cli.stderr)
        table = self.cli.stdout.split("\nrank ", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
        ranked = self.result["ranked"]
        self.assertEqual(len(ranked), len(table))
        self.assertGreater(len(ranked), 1)
        for r, line in zip(ranked, table):
            f = line.split()
            self.assertEqual(int(f[0]), r["rank"])
            self.assertEqual(f[1], r["engine"])
            self.assertEqual(f[2], f"{r['step_time_s'] * 1e3:.3f}")
            self.assertEqual([int(x) for x in f[6:10]], [r["pp"], r["tp"], r["dp"], r["ep"]])
            self.assertTrue(line.endswith("  " + r["strategy"]), line)

    def test_summary_is_the_clis(self):
        out = self.cli.stdout
        cap = re.search(r"memory cap ([\d.]+) GiB", out).group(1)
        self.assertEqual(f"{self.result['memory_cap_bytes'] / 2**30:.2f}", cap)
        reserve = re.search(r"reserve\s+([\d.]+) GiB", out).group(1)
        self.assertEqual(f"{self.result['memory_reserve_bytes'] / 2**30:.2f}", reserve)
        self.assertIn(f"enumerated  {self.result['candidates']} legal candidates", out)
        self.assertIn(f"{self.result['fitting']} fit the cap", out)

    def test_records_have_the_cli_csv_columns_and_values(self):
        header, rows = read_csv(self.cli_csv)
        self.assertEqual(self.result.columns(), ["rank"] + header + ["strategy"])
        cli = {(r["key"], r["engine"]): r for r in rows}
        for rec in self.result.to_records():
            self.assertEqual(list(rec), self.result.columns())
            row = cli[(rec["key"], rec["engine"])]
            for c in header:
                if c not in TIMES:
                    assertSameField(self, rec[c], row[c], f"{rec['key']} {c}")

    def test_best_scenario_simulates_to_the_ranked_step_time(self):
        best = self.result["ranked"][0]
        report = piper.simulate(self.result.scenario())
        self.assertEqual(report["step_time_s"], best["step_time_s"])
        self.assertEqual(report["engine"], best["engine"])
        self.assertIsInstance(self.result.directives(), list)
        with self.assertRaisesRegex(piper.InputError, r"^rank=0: must be from 1 to"):
            self.result.directives(0)

    def test_read_results_of_the_tune_csv(self):
        rows = piper.read_results(self.py_csv)
        by_key = {(r["key"], r["engine"]): r for r in rows}
        for rec in self.result.to_records():
            row = by_key[(rec["key"], rec["engine"])]
            self.assertEqual({k: v for k, v in rec.items() if k not in ("rank", "strategy")}, row)
        self.assertEqual(len(rows), self.result["simulated"] + self.result["simgrid"] + self.result["pruned"]
                         + self.result["bounded"])

    def test_resumes_from_output(self):
        again = piper.tune("qwen3-9m", output=self.py_csv, **self.KWARGS)
        self.assertEqual(again["ran"], 0)
        self.assertGreater(again["resumed"], 0)
        self.assertEqual([r["key"] for r in again["ranked"]], [r["key"] for r in self.result["ranked"]])

    def test_nothing_fits_is_an_empty_ranking(self):
        out = piper.tune("qwen3-9m", devices=2, pp=1, tp=1, zero=0, micro_batch_size=1, recompute="none",
                         schedules="1f1b", top=0, memory_cap_gib=0.01, jobs=1)
        self.assertEqual(out["ranked"], [])
        self.assertEqual(out.to_records(), [])


class Run(unittest.TestCase):
    """piper.run on a tiny model: the losses `piper run` reports, under MPI and as the reference."""

    SCENARIO = {"model": TINY, "strategy": {"pp": 2, "dp": 2, "microbatches": 4}}
    FLAGS = ["--model", TINY, "--pp", "2", "--dp", "2", "--microbatches", "4", "--steps", "3", "--seed", "7"]

    def cli_losses(self, *extra, mpi=True):
        with tempfile.TemporaryDirectory() as tmp:
            report = os.path.join(tmp, "run.json")
            cmd = [CLI, "run", *self.FLAGS, "--report", report, *extra]
            if mpi:
                cmd = [MPIEXEC, "--allow-run-as-root", "--oversubscribe", "-np", "4"] + cmd
            subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120)
            with open(report) as f:
                return json.load(f)["losses"]

    def assertLossesEqual(self, a, b):
        self.assertEqual(len(a), len(b))
        for x, y in zip(a, b):
            self.assertAlmostEqual(x, y, delta=1e-12 * abs(y))

    def test_distributed_losses_are_the_clis(self):
        out = piper.run(self.SCENARIO, steps=3, seed=7, timeout=120)
        self.assertEqual(out["devices"], 4)
        self.assertLossesEqual(out["losses"], self.cli_losses())
        self.assertEqual([r["step"] for r in out.to_records()], [1, 2, 3])
        self.assertEqual([r["loss"] for r in out.to_records()], out["losses"])

    def test_reference_and_plan(self):
        ref = piper.run(self.SCENARIO, steps=3, seed=7, reference=True, timeout=120)
        self.assertLossesEqual(ref["losses"], self.cli_losses("--reference", mpi=False))
        by_plan = piper.run(plan=piper.compile(self.SCENARIO), steps=3, seed=7, timeout=120)
        self.assertLossesEqual(by_plan["losses"], self.cli_losses())

    def test_the_scenarios_train_section_applies_as_the_clis(self):
        # Probe 15: piper.run ignored "train" (3 steps at the default lr where `piper run --scenario`
        # ran 5 at 0.01); a keyword still wins over the section, as a flag does.
        scenario = dict(self.SCENARIO, train={"seed": 7, "lr": 0.01})
        ref = piper.run(scenario, reference=True, timeout=120)
        self.assertEqual(ref["optimizer"]["lr"], 0.01)
        self.assertLossesEqual(ref["losses"], self.cli_losses("--reference", "--lr", "0.01", mpi=False))
        longer = dict(self.SCENARIO, train={"steps": 4})
        self.assertEqual(len(piper.run(longer, reference=True, timeout=120)["losses"]), 4)
        self.assertEqual(len(piper.run(longer, reference=True, steps=2, timeout=120)["losses"]), 2)

    def test_the_scenarios_train_errors_name_its_fields(self):
        # A bad "train" value is named as the scenario's field, as `piper run --scenario` names it, not
        # as the flag piper.run passes on ("--beta2 must be in [0, 1)"); a keyword is still a keyword.
        with self.assertRaisesRegex(piper.InputError, r"^scenario: field 'train\.beta2': must be in \[0, 1\)"):
            piper.run(dict(self.SCENARIO, train={"beta2": 1}), reference=True, timeout=120)
        with self.assertRaisesRegex(piper.InputError, r"^scenario: field 'train\.data': \S*gone\.txt: cannot open"):
            piper.run(dict(self.SCENARIO, train={"data": "gone.txt"}), reference=True, timeout=120)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "s.json")
            with open(path, "w") as f:
                json.dump(dict(self.SCENARIO, strategy={"clip_grad": 1}, train={"loss_scale": 3}), f)
            with self.assertRaisesRegex(piper.InputError, "^" + re.escape(path) + r": field 'train\.loss_scale': "
                                                          r"must be a power of two"):
                piper.run(path, reference=True, timeout=120)
        with self.assertRaisesRegex(piper.InputError, r"^steps=0: "):
            piper.run(dict(self.SCENARIO, train={"steps": 4}), reference=True, steps=0, timeout=120)

    def test_errors_name_the_keyword(self):
        with self.assertRaisesRegex(piper.InputError, r"^resume='/no/such.ckpt': cannot open"):
            piper.run(self.SCENARIO, steps=1, resume="/no/such.ckpt", timeout=120)
        # The CLI says "--data /no/such.bin: ..."; here the keyword.
        with self.assertRaisesRegex(piper.InputError, r"^data='/no/such.bin': cannot open"):
            piper.run(self.SCENARIO, steps=1, data="/no/such.bin", reference=True, timeout=120)


class Plot(unittest.TestCase):
    SPEC = {"model": "qwen3-9m", "engine": "analytic", "pp": [1, 2, 4], "ep": [1, 3], "microbatches": 4}

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.csv = os.path.join(cls.tmp.name, "sweep.csv")
        piper.sweep(cls.SPEC, output=cls.csv)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_svg_is_valid_and_skips_blank_rows(self):
        svg = os.path.join(self.tmp.name, "plot.svg")
        out = piper.plot(self.csv, x="pp", y="step_time_s", series="ep", line=True, output=svg, title="step time")
        # EP 3 does not divide DP 1: those 3 rows have blank figures and are skipped, never drawn as 0.
        self.assertEqual((out["points"], out["series"], out["skipped"]), (3, 1, 3))
        root = ET.parse(svg).getroot()
        self.assertEqual(root.tag, "{http://www.w3.org/2000/svg}svg")
        ns = {"s": "http://www.w3.org/2000/svg"}
        groups = root.findall("s:g[@class='series']", ns)
        self.assertEqual(len(groups), 1)
        self.assertEqual(len(groups[0].findall("s:circle", ns)), 3)
        self.assertEqual(len(groups[0].findall("s:polyline", ns)), 1)
        texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
        self.assertIn("step time", texts)
        self.assertIn("ep = 1", texts)

    def test_counts_are_the_clis(self):
        png = os.path.join(self.tmp.name, "cli.png")
        cli = run_cli("plot", self.csv, "--x", "pp", "--y", "step_time_s", "--series", "ep", "-o", png, check=False)
        if cli.returncode != 0 and "without Qt" in cli.stderr:
            self.skipTest("piper was built without Qt 6 Gui")
        m = re.match(r"(\d+) points in (\d+) series \((\d+) rows without numbers skipped\)", cli.stdout)
        out = piper.plot(self.csv, x="pp", y="step_time_s", series="ep", output=os.path.join(self.tmp.name, "a.svg"))
        self.assertEqual((out["points"], out["series"], out["skipped"]), tuple(int(g) for g in m.groups()))
        png_out = piper.plot(self.csv, x="pp", y="step_time_s", series="ep", output=os.path.join(self.tmp.name, "a.png"))
        self.assertEqual(png_out["points"], out["points"])
        with open(os.path.join(self.tmp.name, "a.png"), "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")

    def test_ticks(self):
        from piper import _svg
        self.assertEqual(_svg.nice_ticks(0, 130, False), [0, 20, 40, 60, 80, 100, 120])
        self.assertEqual(_svg.nice_ticks(1, 1e6, True), [1, 10, 100, 1e3, 1e4, 1e5, 1e6])
        # Less than a decade: 1, 2 and 5 per decade are too few, so every digit.
        self.assertEqual(_svg.nice_ticks(3e7, 9e7, True), [3e7, 4e7, 5e7, 6e7, 7e7, 8e7, 9e7])
        self.assertEqual([_svg.tick_label(v) for v in (0.25, 1500, 2e7, 3e9)], ["0.25", "1.5k", "20M", "3G"])

    def test_where_and_errors(self):
        out = piper.plot(self.csv, x="pp", y="peak_memory_bytes", where={"ep": 1}, log_y=True,
                         output=os.path.join(self.tmp.name, "w.svg"))
        self.assertEqual((out["points"], out["series"], out["skipped"]), (3, 1, 0))
        with self.assertRaisesRegex(piper.InputError, r"no row has numbers in both 'pp' and 'step_time_s'"):
            piper.plot(self.csv, x="pp", y="step_time_s", where={"status": "invalid"},
                       output=os.path.join(self.tmp.name, "w.svg"))
        with self.assertRaisesRegex(piper.InputError, r"^y='step_time': no such column in .*"
                                                      r"\(did you mean 'step_time_s'\?\); columns: key, "):
            piper.plot(self.csv, x="pp", y="step_time", output=os.path.join(self.tmp.name, "e.svg"))
        with self.assertRaisesRegex(piper.InputError, r"^output='x.jpg': expected a .svg or .png"):
            piper.plot(self.csv, x="pp", y="step_time_s", output="x.jpg")
        self.assertFalse(os.path.exists(os.path.join(self.tmp.name, "e.svg")))


if __name__ == "__main__":
    unittest.main()
