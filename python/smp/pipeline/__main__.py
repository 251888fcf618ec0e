"""`python -m smp.pipeline --pp 4 --microbatches 8 --schedule interleaved` prints a schedule's
timeline as text (smp.schedules.render_text). A module of its own, so that `-m` does not
run the schedule modules a second time beside the copy `import smp` already loaded."""

from smp.schedules import main

main()
