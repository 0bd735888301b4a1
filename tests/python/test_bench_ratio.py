"""Tests of scripts/measure/bench_ratio.py (what scripts/gpu-check.sh prints after the dense-1b benchmark):
on the H200 logs of issue 25 (the lines below are copied from ../shared/measurements/h200/), the ratios
worked out by hand; a log without its line is refused in one line, exit 2."""
import os
import subprocess
import sys
import tempfile
import unittest

SOURCE_DIR = os.environ.get("PIPER_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SCRIPT = os.path.join(SOURCE_DIR, "scripts", "measure", "bench_ratio.py")

PIPER_LOG = """step    5  loss 13.411985  (176.8 ms)
device: NVIDIA H200 (132 SMs)
dense-1b bf16, 1 GPU, 5 steps; attention: fast path (flash)
first step 322.6 ms; steady step 177.4 ms (mean of steps 2..5), 46190 tokens/s, model 54.36 TFLOP/step, 306.5 TFLOP/s
MFU 31.0 % of 989.4 TFLOP/s (target >= 50 %)
"""
TORCH_LOG = """2.11.0+cu130 NVIDIA H200
torch eager: params 1.104 B, step 123.3 ms (median of 6), 66,451 tok/s, model TFLOP/s 428, MFU 43.2 % of 989.4
torch compile: params 1.104 B, step 103.0 ms (median of 6), 79,496 tok/s, model TFLOP/s 511, MFU 51.7 % of 989.4
"""


class BenchRatio(unittest.TestCase):
    def run_script(self, piper, torch):
        with tempfile.TemporaryDirectory() as d:
            paths = []
            for name, text in (("piper.log", piper), ("torch.log", torch)):
                paths.append(os.path.join(d, name))
                with open(paths[-1], "w") as f:
                    f.write(text)
            r = subprocess.run([sys.executable, SCRIPT] + paths, capture_output=True, text=True)
            return r.returncode, r.stdout, r.stderr.replace(d + os.sep, "")

    def test_ratios_of_the_h200_run(self):
        code, out, err = self.run_script(PIPER_LOG, TORCH_LOG)
        self.assertEqual((code, err), (0, ""))
        # 46190 / 66451 = 0.6951, 46190 / 79496 = 0.5810
        self.assertEqual(out.splitlines(), [
            "piper: 46,190 tok/s (177.4 ms/step)",
            "piper / PyTorch eager: 0.695 (46,190 vs 66,451 tok/s; 177.4 vs 123.3 ms/step)",
            "piper / torch.compile: 0.581 (46,190 vs 79,496 tok/s; 177.4 vs 103.0 ms/step)",
        ])

    def test_eager_only(self):
        code, out, _ = self.run_script(PIPER_LOG, TORCH_LOG.splitlines()[1] + "\n")
        self.assertEqual(code, 0)
        self.assertEqual(len(out.splitlines()), 2)
        self.assertIn("piper / PyTorch eager: 0.695", out)

    def test_a_log_without_its_line_is_refused_in_one_line(self):
        code, out, err = self.run_script("benchmark failed\n", TORCH_LOG)
        self.assertEqual((code, out), (2, ""))
        self.assertEqual(err, "bench_ratio: piper.log: no 'steady step ... tokens/s' line of bench_cuda_step\n")
        code, out, err = self.run_script(PIPER_LOG, "ModuleNotFoundError: No module named 'torch'\n")
        self.assertEqual((code, out), (2, ""))
        self.assertEqual(err.count("\n"), 1)
        self.assertTrue(err.startswith("bench_ratio: torch.log: no 'torch eager: ...'"), err)


if __name__ == "__main__":
    unittest.main()
