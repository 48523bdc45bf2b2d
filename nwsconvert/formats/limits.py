"""Bounds every reader checks a header's sizes against before it allocates (imports nothing)."""

#: Entries per pool (the rANS coder's 24-bit model bounds index histograms too).
MAX_POOL_SIZE = 1 << 24
#: Floats per pool vector (a 256 x 256 kernel).
MAX_VECTOR_SIZE = 1 << 16
#: Kernels one layer may hold (a 16384 x 16384 linear layer).
MAX_KERNELS = 1 << 28
#: Integer model-factory arguments a manifest may record (in_chans, num_classes, image_size...).
MAX_FACTORY_INT = 1 << 15
