"""Inference: `torchsprint serve` under load beside other servers, and predict's throughput."""
