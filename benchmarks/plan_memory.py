"""The planner's memory model against real smp runs on CPU: the table in docs/benchmarks.md.

    python benchmarks/plan_memory.py

Runs tests/python/plan_validation.py's launch (a small Hugging Face GPT-2, one step per layout on
two ranks) and prints, per layout, what the fullest rank held (parameters, gradients, optimizer
state and masters, saved-activation peak) against the planner's estimate of the same sum, from
the module's measured counts and from its config's formula.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests", "python"), os.path.join(HERE, "..", "python")]

PARTS = ("parameters", "gradients", "optimizer", "activations")


def main() -> None:
    import plan_validation
    from harness import run_ranks

    ranks = run_ranks(plan_validation.run, 2, timeout=600)
    predicted = ranks[0]["predicted"]
    mib = 2**20
    print(
        "| layout | measured MiB (params / grads / optimizer / saved activations) | "
        "predicted MiB, module | ratio | predicted MiB, config | ratio |"
    )
    print("|---|---|---|---|---|---|")
    for i, (name, _) in enumerate(plan_validation.LAYOUTS):
        fullest = max((r["measured"][i] for r in ranks), key=lambda m: sum(m[k] for k in PARTS))
        held = sum(fullest[k] for k in PARTS)
        parts = " / ".join(f"{fullest[k] / mib:.2f}" for k in PARTS)
        module, config = predicted[name]["module"], predicted[name]["config"]
        print(
            f"| {name} | {held / mib:.2f} ({parts}, stage {fullest['stage']}) | {module / mib:.2f} | "
            f"{module / held:.3f} | {config / mib:.2f} | {config / held:.3f} |"
        )


if __name__ == "__main__":
    main()
