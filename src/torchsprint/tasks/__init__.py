"""What a run learns (tasks), its metrics, test-time augmentation."""
