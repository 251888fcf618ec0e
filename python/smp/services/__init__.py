"""Services every parallelism uses and none owns: the timeline, the microbatch threads and the
saved-activation meter. They sit below the parallelisms and import none of them."""
