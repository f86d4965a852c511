"""Procedural shapes: determinism by (seed, index), masks consistent with the images and with the geometry."""

import math

import numpy as np
import pytest
import torch

from zoo.data.shapes import CLASSES, ShapesImages, ShapesSegmentation, stack


def test_samples_are_pure_functions_of_seed_and_index():
    a, b = ShapesSegmentation(32, seed=3), ShapesSegmentation(32, seed=3)
    order = [7, 0, 7, 123, 5]
    first = {i: a[i] for i in order}
    for i in reversed(order):  # another instance, another access order
        img, mask = b[i]
        assert torch.equal(img, first[i][0]) and torch.equal(mask, first[i][1])
    assert not torch.equal(a[0][0], a[1][0]), "different indices must differ"
    assert not torch.equal(a[0][0], ShapesSegmentation(32, seed=4)[0][0]), "different seeds must differ"
    assert torch.equal(ShapesImages(32, seed=3)[7], first[7][0]), "the diffusion images are the same generator's"


def test_types_ranges_and_labels():
    ds = ShapesSegmentation(24, seed=1, channels=3)
    seen = set()
    for i in range(50):
        img, mask = ds[i]
        assert img.shape == (3, 24, 24) and img.dtype == torch.float32
        assert mask.shape == (24, 24) and mask.dtype == torch.int64
        assert img.min() >= -1 and img.max() <= 1
        kinds = {s.label for s in ds.shapes(i)}
        labels = set(mask.unique().tolist())
        assert labels - {0} <= kinds, f"sample {i}: mask labels {labels} not among its shapes {kinds}"
        seen |= labels
    assert seen == set(range(len(CLASSES))), f"50 samples should show every class, saw {seen}"
    with pytest.raises(IndexError):
        ds[len(ds)]
    images, masks = stack(ds, [0, 1, 2])
    assert images.shape == (3, 3, 24, 24) and masks.shape == (3, 24, 24)
    assert stack(ShapesImages(24, seed=1), [0, 1]).shape == (2, 3, 24, 24)


def test_mask_matches_image_colours_without_noise():
    """Noise off: every pixel has the colour of the shape its mask names (the last painted one covering it)."""
    ds = ShapesSegmentation(32, seed=2, noise=0.0)
    for i in range(20):
        img, mask = ds[i]
        shapes = ds.shapes(i)
        for label in mask.unique().tolist():
            if label == 0:
                continue
            pix = img[:, mask == label]  # [C, n]
            colours = [torch.tensor(s.color).clamp(-1, 1) for s in shapes if s.label == label]
            # each pixel shows one of the shapes of that kind
            ok = torch.zeros(pix.shape[1], dtype=torch.bool)
            for c in colours:
                ok |= torch.isclose(pix, c[:, None].float(), atol=1e-6).all(0)
            assert ok.all(), f"sample {i}: {int((~ok).sum())} pixels labelled {CLASSES[label]} have another colour"
        background = img[:, mask == 0]
        for s in shapes:  # shape colours are >= 0.6 away from the background's base; the gradient is <= 0.3
            far = (background - torch.tensor(s.color)[:, None].float()).abs().amax(0)
            assert (far > 0.25).all(), f"sample {i}: a background pixel has {s.kind}'s colour"


@pytest.mark.parametrize("kind,area", [("circle", lambda r: math.pi * r * r), ("square", lambda r: 4 * r * r),
                                       ("triangle", lambda r: 3 * math.sqrt(3) / 4 * r * r)])
def test_single_shape_area_matches_geometry(kind, area):
    """One shape per image: the labelled area is the shape's area (pixel-centre sampling: within a perimeter)."""
    ds = ShapesSegmentation(48, seed=5, max_shapes=1, noise=0.0)
    checked = 0
    for i in range(200):
        (s,), (_, mask) = ds.shapes(i), ds[i]
        if s.kind != kind or min(s.cx, s.cy, 48 - s.cx, 48 - s.cy) < s.radius * math.sqrt(2):
            continue  # keep shapes fully inside the image
        n = int((mask == s.label).sum())
        assert set(np.unique(mask.numpy())) == {0, s.label}
        assert abs(n - area(s.radius)) <= 2 * math.pi * s.radius + 4, (i, n, area(s.radius))
        centre = mask[int(s.cy), int(s.cx)]
        assert centre == s.label, f"sample {i}: the centre of a {kind} is not labelled {kind}"
        checked += 1
    assert checked >= 5, f"only {checked} {kind}s fully inside the image were checked"


def test_centre_offset_places_shapes_near_the_centre_and_changes_nothing_else():
    """centre_offset=0: every shape sits at the image centre (its pixel labelled), offset 0.1: within 0.1 of the side;
    kind, size, rotation, colours, background and noise are the same draws as placed anywhere."""
    size, radius = 32, (0.35, 0.35)
    anywhere = ShapesSegmentation(size, seed=4, max_shapes=1, radius_range=radius)
    centred = ShapesSegmentation(size, seed=4, max_shapes=1, radius_range=radius, centre_offset=0.0)
    near = ShapesSegmentation(size, seed=4, max_shapes=1, radius_range=radius, centre_offset=0.1)
    kinds, moved = set(), 0
    for i in range(30):
        (a,), (c,), (n,) = anywhere.shapes(i), centred.shapes(i), near.shapes(i)
        assert (c.cx, c.cy) == (size / 2, size / 2)
        assert max(abs(n.cx - size / 2), abs(n.cy - size / 2)) <= 0.1 * size
        for other in (c, n):
            assert (other.kind, other.radius, other.angle, other.color) == (a.kind, a.radius, a.angle, a.color)
        assert a.radius == 0.35 * size
        image, mask = centred[i]
        assert mask[size // 2, size // 2] == c.label
        other_image, other_mask = anywhere[i]
        both = (mask == 0) & (other_mask == 0)
        assert both.sum() > 100 and torch.equal(image[:, both], other_image[:, both]), \
            "the background (colour, gradient, noise) is the same draw"
        kinds.add(c.kind)
        moved += (a.cx, a.cy) != (c.cx, c.cy)
    assert kinds == {"circle", "square", "triangle"} and moved == 30
    for bad in (-0.1, 0.6):
        with pytest.raises(ValueError, match="centre_offset must be in"):
            ShapesSegmentation(size, centre_offset=bad)


def test_write_folders_round_trip(tmp_path):
    from zoo.data.image_folders import match_pairs, read_mask
    from zoo.data.shapes import ShapesSegmentation, main

    assert main(["--out", str(tmp_path), "--num", "3", "--size", "16"]) == 0
    pairs = match_pairs(tmp_path / "images", tmp_path / "masks")
    assert [stem for stem, *_ in pairs] == ["00000", "00001", "00002"]
    ds = ShapesSegmentation(16, seed=0, length=3)
    for i, (_, _, mask_path) in enumerate(pairs):
        assert torch.equal(read_mask(mask_path), ds[i][1])  # labels survive the PNG exactly
