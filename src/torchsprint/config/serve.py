"""The config schema's `serve` section: how `torchsprint serve` answers HTTP requests (address, batching, limits,
authentication). Every field is also a `torchsprint serve` flag."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from torchsprint.config.sections import Section


class ServeConfig(Section):
    host: str = Field(
        "127.0.0.1",
        description="Address to listen on. 127.0.0.1 (this machine only) unless told "
        "otherwise: 0.0.0.0 exposes the model to the network (a container behind a load balancer).",
    )
    port: int = Field(
        8000,
        ge=0,
        le=65535,
        description="TCP port; 0 takes a free one (the start-up line prints it). "
        "A port in use is refused before the model loads.",
    )
    max_batch: int = Field(
        32,
        ge=1,
        le=1024,
        description="Most images in one forward pass: waiting images are "
        "gathered up to this many (or max_wait_ms). Batches are padded to powers of two up to it "
        "when `buckets` is on.",
    )
    max_wait_ms: float = Field(
        5.0,
        ge=0,
        le=10_000,
        description="How long the first waiting image waits for others "
        "to join its batch (milliseconds). 0: every forward takes what is waiting, no more.",
    )
    queue_limit: int = Field(
        256,
        ge=1,
        description="Most images accepted and not yet in a forward pass (decoding or "
        "waiting). A request that would pass it is answered 503 with Retry-After at once, so "
        "latency stays bounded under overload; a request with more images than this is a 413.",
    )
    timeout_s: float = Field(
        30.0,
        gt=0,
        description="A request not answered this many seconds after it arrived gets "
        "503 (timeout) with Retry-After; its images are dropped from the queue if not yet run.",
    )
    workers: int = Field(
        1,
        ge=1,
        le=64,
        description="Server processes (uvicorn workers), each with its own copy of "
        "the model, sharing the port; /metrics adds them up.",
    )
    runtime: Literal["auto", "torch", "onnxruntime"] = Field(
        "auto",
        description="Inference engine: torch, or onnxruntime (a run folder is exported to ONNX first, once). "
        "auto: torch for a run folder or a .safetensors file, onnxruntime for a .onnx file.",
    )
    device: str = Field(
        "auto",
        description="'auto' (CUDA when present, else CPU), 'cpu', 'cuda' or 'cuda:N'. On CUDA, "
        "3-channel JPEGs decode with nvJPEG and the eval spec runs on the GPU (as `predict --device "
        "cuda`).",
    )
    token: str | None = Field(
        None,
        description="Bearer token every /predict and /metrics request must send "
        "(Authorization: Bearer <token>); None: no authentication. The environment variable "
        "TORCHSPRINT_SERVE_TOKEN sets it without writing it in a file.",
    )
    max_body_mb: float = Field(20.0, gt=0, description="Largest request body in MiB (413 above it, read no further).")
    max_pixels: int = Field(
        40_000_000,
        ge=1,
        description="Largest image in pixels (width x height), checked from "
        "the file's header before decoding: decompression bombs get 422, not the server's memory.",
    )
    max_model_pixels: int | Literal["auto"] = Field(
        "auto",
        description="Largest model input in pixels (height x width after the eval preprocessing): a larger "
        "image gets 422 (too_many_pixels), and a batch never holds more pixels than this. It applies where "
        "data.eval.transforms keeps each file's size (no resize to [H, W] or crop): there a forward pass costs memory "
        "and time in proportion to the image's pixels. auto: 4x the largest training image the run's decisions.json "
        "records (or the training crop, if larger), and at least 512x512; a model file, which records no image "
        "sizes, gets the training crop's rule or 512x512. Where the eval spec fixes the size, that size is the model "
        "input: a value below it is refused (every image would be).",
    )
    topk: int = Field(5, ge=1, description="Classes returned per image when the request does not say (?topk=N).")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="How the torch model runs: fp32, or bf16 (bfloat16 autocast, channels_last where the run "
        "trained so). auto: bf16 where the run trained and validated in bf16 and this CPU computes bf16 natively "
        "(AVX-512 BF16, AMX), else fp32; `predict --precision` makes the same choice, so answers equal predict's. "
        "An ONNX file runs in fp32.",
    )
    buckets: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Pad each batch to the next power of two up to max_batch, so the model sees a few fixed "
        "shapes (what compiled graphs and CUDA graphs need). auto: on for CUDA, off on the CPU (padding costs CPU "
        "time and eager kernels need no fixed shapes).",
    )

    @field_validator("token")
    @classmethod
    def _token(cls, v: str | None) -> str | None:
        if v is not None and (not v.strip() or v != v.strip()):
            raise ValueError("must be a non-empty token without surrounding spaces (null: no authentication)")
        return v

    @field_validator("max_model_pixels")
    @classmethod
    def _model_pixels(cls, v):
        if v != "auto" and v < 1:
            raise ValueError("must be 'auto' or a number of pixels >= 1")
        return v
