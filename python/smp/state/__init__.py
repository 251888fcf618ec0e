"""Checkpoint state: where each tensor of this rank sits in the original model, and how it is
read, written and resharded, whatever the layout.

- sliced.py: a rank's part of a tensor as slices of the full one (torch.distributed.checkpoint's
  chunks);
- model_state.py: the full state_dict from the parts (and back), and where every tensor sits;
- layout_free.py: optimizer state keyed by parameter name and full shape, not by layout;
- storage.py: reading and writing through torch.distributed.checkpoint, and SMP v1's files;
- snapshot.py: when a background save's copy of the state is complete (the optimizer waits);
- writer_process.py: a process of a rank's own that writes a background save's tensor files.

smp.checkpoint (smp.save, smp.load, smp.save_checkpoint, smp.resume_from_checkpoint) is the API
over it.
"""
