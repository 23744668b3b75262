"""The defaults a run chooses for a user's own images, measured: the photo model, size, learning rate, fine-tuning,
imbalanced classes, channels_last."""
