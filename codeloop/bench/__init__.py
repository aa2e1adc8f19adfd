"""The benchmarks behind `codeloop bench ...`, apart from the product code they measure.

`sandbox` (throughput and latency over the sandbox servers; `overload`, its overload cases),
`reward` (the verifier against plain math-verify on the labelled cases), `scheduler` (the
rollout schedulers over simulated engines), `rollout` (the in-process engine against
transformers' own generation; `static_engine`, the static-batch engine kept as a baseline) and
`train` (an RL step's throughput, memory and split). Each prints ratios against a baseline
measured in the same run and writes its figures to `bench-results/NAME.json`.
"""
