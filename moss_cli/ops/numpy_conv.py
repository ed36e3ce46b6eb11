"""Image ops for the VAE decoder: conv2d, group norm, nearest upsampling."""


class ConvOps:
    pass
