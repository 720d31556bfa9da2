"""The step's programs priced from the target compiler's counts beside the simulator's hand
formulas: ``python benchmarks/compiled_vs_roofline.py CONFIG REPORT.json MODEL:HARDWARE``,
where REPORT.json is ``oppo-jax compile-plan CONFIG --json`` (docs/benchmarks/aot/). Prints a
markdown table (oppo_tools.sim.compiled); docs/PROJECTIONS.md keeps the ones quoted."""

import json
import sys

from oppo_jax.config import load_config
from oppo_jax.parallel.targets import Target
from oppo_jax.pipeline.compile_plan import run_shapes
from oppo_jax.pipeline.schedule import Schedule
from oppo_tools.sim.compiled import compare, format_rows
from oppo_tools.sim.project import build_projection
from oppo_tools.sim.roofline import parse_spec


def main(config: str, report_path: str, spec: str) -> None:
    cfg = load_config(config)
    report = json.loads(open(report_path).read())
    platform = Target.parse(report["target"]).platform
    shapes = run_shapes(cfg, Schedule.named(report["mode"]), platform)
    projection = build_projection(spec, config)
    hardware = parse_spec(spec)[1]
    run = (projection.mfu, cfg.ppo.num_minibatches)
    rows = compare(report, projection.cost_model(), hardware, shapes, run)
    print(f"{config}, {report['mode']}, compiled for {report['target']} by {report['compiler']};")
    print(f"hand formulas: {projection.cost_model().label}, {projection.train.describe()}")
    print("\n".join(format_rows(rows)))


if __name__ == "__main__":
    main(*sys.argv[1:4])
