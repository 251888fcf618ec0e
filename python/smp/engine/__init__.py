"""The engine: a Plan made once per model (plan.py), a Program built per input signature
(build.py, programs.py), the executor that runs a step (executor.py), and the Engine that keeps
the step lifecycle, gradient synchronization and hooks (engine.py)."""

from smp.engine.build import Program, build
from smp.engine.engine import Engine
from smp.engine.plan import Plan, make_plan, place_whole

__all__ = ["Engine", "Plan", "Program", "build", "make_plan", "place_whole"]
