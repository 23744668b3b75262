"""torchsprint beside other tools on the same job: timm's train.py, PyTorch Lightning, a plain PyTorch loop,
torchvision's reference script (speed and memory), and the CPU's ceiling for that job."""
