"""Pipeline parallelism: schedules as data, microbatch threads, the stage runtime, placement."""
