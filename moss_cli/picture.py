"""Pictures in: a PNG, JPEG or WebP read with pillow (turned upright by its EXIF orientation, as diffusers'
load_image does) and brought to the VAE encoder's input as diffusers' image processors do (Flux2ImageProcessor:
resize, then RGB, then [-1, 1]), and an inpainting mask brought to the latent grid as FluxInpaintPipeline's mask
processor and prepare_mask_latents do.
"""

import hashlib
import io
from dataclasses import dataclass

import numpy as np

from .errors import PictureError, UsageError

FORMATS = ("PNG", "JPEG", "WEBP")
MULTIPLE = 16        # VaeImageProcessor(vae_scale_factor=16) of the FLUX pipelines: sizes floored to multiples of 16
RESAMPLE = "lanczos"  # VaeImageProcessor's resample, PIL.Image.Resampling.LANCZOS (reducing_gap None)
VAE_FACTOR = 8       # pixels per latent pixel before the 2x2 patchify: the mask's grid in prepare_mask_latents


@dataclass
class Picture:
    image: object        # a loaded PIL.Image in its own mode (RGBA, L, P... are converted after the resize)
    sha256: str          # of the file's bytes
    source: str

    @property
    def size(self):
        return self.image.size

    def target(self, width=None, height=None, option="--width/--height"):
        """(width, height) the picture is resized to: the given ones, else its own floored to multiples of 16
        (VaeImageProcessor.get_default_height_width)."""
        w = self.image.width - self.image.width % MULTIPLE if width is None else width
        h = self.image.height - self.image.height % MULTIPLE if height is None else height
        for name, v in (("width", w), ("height", h)):
            if v <= 0 or v % MULTIPLE:
                given = width if name == "width" else height
                if given is None:
                    raise PictureError(f"{self.source}: {self.image.width}x{self.image.height} is too small; the "
                                       f"{name} floors to {v}, the VAE needs a positive multiple of {MULTIPLE}")
                raise UsageError(f"--{name} {v}: must be a positive multiple of {MULTIPLE}")
        return w, h

    def _resized(self, width, height):
        from PIL import Image
        return self.image.resize((width, height), resample=Image.Resampling.LANCZOS, reducing_gap=None)

    def rgb(self, width, height):
        """float32 [3, H, W] in [-1, 1]: resized in the picture's own mode, converted to RGB (alpha dropped,
        gray repeated), /255, 2x - 1, as Flux2ImageProcessor.preprocess does."""
        a = np.array(self._convert(self._resized(width, height), "RGB")).astype(np.float32) / np.float32(255)
        return np.ascontiguousarray((np.float32(2) * a - np.float32(1)).transpose(2, 0, 1))

    def mask(self, width, height):
        """float32 [H, W] of 0 and 1 (1 = repaint): resized, converted to grayscale, /255, then < 0.5 -> 0 and
        >= 0.5 -> 1, as FluxInpaintPipeline's mask processor does."""
        a = np.array(self._convert(self._resized(width, height), "L")).astype(np.float32) / np.float32(255)
        return np.where(a < np.float32(0.5), np.float32(0), np.float32(1))

    def transparent_repaints(self):
        """The mask as OpenAI's image edits read it: repaint (white) where the picture is fully transparent, keep
        (black) elsewhere; a picture without alpha is the mask it is (white repaints). The file's sha256 stays."""
        from PIL import Image
        image = self.image
        if image.mode == "P" and "transparency" in image.info:
            image = image.convert("RGBA")
        if "A" not in image.getbands():
            return self
        alpha = np.array(image.getchannel("A"))
        return Picture(Image.fromarray(np.where(alpha == 0, 255, 0).astype(np.uint8), "L"), self.sha256, self.source)

    def _convert(self, image, mode):
        try:
            return image.convert(mode)
        except (ValueError, OSError) as e:
            raise PictureError(f"{self.source}: cannot convert its mode {image.mode} to {mode} ({e})") from None


def read(path):
    """The Picture of PATH ('-' for stdin), loaded in full so a truncated file fails here."""
    from .artifacts import read_input
    data, source = read_input(path, "a picture", "a picture", PictureError)
    return from_bytes(data, source)


def from_bytes(data, source):
    """The Picture of a file's bytes (SOURCE names it in errors), loaded in full."""
    from PIL import Image, UnidentifiedImageError
    if not data:
        raise PictureError(f"{source}: empty, not a picture")
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
        image.load()
    except UnidentifiedImageError:
        raise PictureError(f"{source}: not a PNG, JPEG or WebP picture") from None
    except Image.DecompressionBombError as e:
        raise PictureError(f"{source}: {e}") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise PictureError(f"{source}: truncated or corrupt picture ({e})") from None
    if image.format in ("WEBP", "PNG") and getattr(image, "n_frames", 1) > 1:     # a JPEG's MPO frames are
        raise PictureError(f"{source}: an animated picture ({image.n_frames} frames); give a still one")  # previews
    return Picture(eight_bit(upright(image)), hashlib.sha256(data).hexdigest(), source)


def eight_bit(image):
    """A 16-bit grayscale picture (pillow's modes I;16 and I) as 8-bit L, each value's top 8 bits: pillow's own
    conversion of these modes to L or RGB clips at 255, which would leave a picture of 0..65535 nearly white.
    Other modes as they are (16-bit RGB is read as 8-bit RGB already)."""
    if not image.mode.startswith("I"):
        return image
    from PIL import Image
    values = np.asarray(image, dtype=np.int64)
    return Image.fromarray((np.clip(values, 0, 65535) >> 8).astype(np.uint8), "L")


def upright(image):
    """IMAGE turned as its EXIF orientation tag says (a phone's JPEG stored sideways), as diffusers' load_image
    turns it (PIL.ImageOps.exif_transpose) before a pipeline sees it; a picture without the tag as it is."""
    from PIL import ImageOps
    try:
        turned = ImageOps.exif_transpose(image)
    except (OSError, SyntaxError, ValueError, TypeError):     # an unreadable EXIF block: the pixels as stored
        return image
    return image if turned is None else turned


def nearest_rows(size_in, size_out):
    """The source index of each output index of torch's nearest interpolation (floor(i * in/out) in float32)."""
    scale = np.float32(size_in / size_out)
    return np.minimum(np.floor(np.arange(size_out, dtype=np.float32) * scale).astype(np.int64), size_in - 1)


def latent_mask(mask, channels, patch=(2, 2)):
    """A [H, W] mask on the packed latent grid [1, channels, H/16, W/16]: nearest-interpolated to the VAE's
    [H/8, W/8] grid, repeated over the latent channels and patchified like the latents (prepare_mask_latents)."""
    h, w = mask.shape
    pi, pj = patch
    small = mask[nearest_rows(h, h // VAE_FACTOR)][:, nearest_rows(w, w // VAE_FACTOR)]
    lat = channels // (pi * pj)
    grid = np.broadcast_to(small, (lat,) + small.shape).reshape(lat, h // (VAE_FACTOR * pi), pi, w // (VAE_FACTOR * pj), pj)
    return np.ascontiguousarray(grid.transpose(0, 2, 4, 1, 3).reshape(1, channels, h // (VAE_FACTOR * pi), w // (VAE_FACTOR * pj)), dtype=np.float32)
