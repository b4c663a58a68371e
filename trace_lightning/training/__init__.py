"""The update: the LightningModule, tree packing and its attention, mini-batches, FSDP
strategies, checkpoints and the policy's export.
"""
