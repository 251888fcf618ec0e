"""Pipeline parallelism: placement, the rank and stage runtimes, the message order, the backward split
(the schedules are smp.schedules, the microbatch threads smp.services)."""
