"""Image/mask folders: pairing by stem, reading, the checks (one line each), the index space, the split."""

import numpy as np
import pytest
import torch
from PIL import Image

from zoo.data.image_folders import (
    ImageFolder,
    ImageFolderError,
    ImageMaskFolders,
    match_pairs,
    read_image,
    read_mask,
    save_image,
    save_mask,
    split_stems,
)
from zoo.data.shapes import ShapesSegmentation


def write_pairs(root, n=6, size=16, seed=0, image_ext=".png"):
    """``n`` shapes samples as images/ and masks/ folders; returns the samples."""
    ds = ShapesSegmentation(size, seed=seed)
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "masks").mkdir(parents=True, exist_ok=True)
    samples = [ds[i] for i in range(n)]
    for i, (image, mask) in enumerate(samples):
        save_image(root / "images" / f"s{i:03d}{image_ext}", image)
        save_mask(root / "masks" / f"s{i:03d}.png", mask)
    return samples


def test_round_trip_png_and_jpeg(tmp_path):
    samples = write_pairs(tmp_path, n=2)
    image, mask = read_image(tmp_path / "images/s000.png"), read_mask(tmp_path / "masks/s000.png")
    assert image.shape == (3, 16, 16) and image.dtype == torch.float32 and mask.dtype == torch.int64
    torch.testing.assert_close(image, samples[0][0], atol=1 / 127.5, rtol=0)  # 8-bit quantization
    assert torch.equal(mask, samples[0][1])
    gray = read_image(tmp_path / "images/s000.png", channels=1)
    assert gray.shape == (1, 16, 16) and -1 <= gray.min() and gray.max() <= 1
    jpeg = tmp_path / "x.jpg"
    Image.fromarray(np.full((8, 8, 3), 200, np.uint8)).save(jpeg)
    torch.testing.assert_close(read_image(jpeg), torch.full((3, 8, 8), 200 / 127.5 - 1), atol=0.02, rtol=0)
    palette = Image.fromarray(np.array([[0, 1], [2, 3]], np.uint8)).convert("P")
    palette.save(tmp_path / "p.png")
    assert read_mask(tmp_path / "p.png").tolist() == [[0, 1], [2, 3]]


def test_pairs_by_stem_and_dataset(tmp_path):
    samples = write_pairs(tmp_path, n=5, image_ext=".jpg")  # formats may differ between image and mask
    pairs = match_pairs(tmp_path / "images", tmp_path / "masks")
    assert [s for s, _, _ in pairs] == [f"s{i:03d}" for i in range(5)]
    ds = ImageMaskFolders(tmp_path / "images", tmp_path / "masks", seed=3)
    assert len(ds) == 5 and ds.check(classes=4, depth=2) == (16, 16)
    epoch0 = [int(ds.position(i)[0]) for i in range(5)]
    epoch1 = [int(ds.position(i)[0]) for i in range(5, 10)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(5)), "each epoch visits every pair once"
    assert epoch0 != epoch1 or epoch0 != list(range(5))
    again = ImageMaskFolders(tmp_path / "images", tmp_path / "masks", seed=3)
    for i in (7, 0, 12):  # a pure function of the index, in any order of access
        a, b = ds[i], again[i]
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(ds[0][1], samples[epoch0[0]][1])
    plain = ImageMaskFolders(tmp_path / "images", tmp_path / "masks", shuffle=False)
    assert torch.equal(plain[6][1], samples[1][1])
    flipped = ImageMaskFolders(tmp_path / "images", tmp_path / "masks", shuffle=False, augment=True)
    flips = [flipped.position(i)[1] for i in range(40)]
    assert any(flips) and not all(flips)
    i = flips.index(True)
    assert torch.equal(flipped[i][1], plain[i][1].flip(-1))
    images = ImageFolder(tmp_path / "images", shuffle=False)
    assert len(images) == 5 and images.check(depth=3) == (16, 16) and images[0].shape == (3, 16, 16)


def test_split_is_seeded_and_disjoint():
    stems = [f"s{i}" for i in range(20)]
    train, valid = split_stems(stems, 0.25, seed=1)
    assert len(valid) == 5 and not set(train) & set(valid) and sorted(train + valid) == sorted(stems)
    assert split_stems(stems, 0.25, seed=1) == (train, valid)
    assert split_stems(stems, 0.0, seed=1) == (stems, [])
    assert split_stems(stems[:2], 0.01, seed=1)[1] and split_stems(stems[:2], 0.99, seed=1)[0]


def one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


def test_mismatched_folders_name_the_first_unmatched_files(tmp_path):
    write_pairs(tmp_path, n=4)
    (tmp_path / "masks/s001.png").unlink()
    Image.fromarray(np.zeros((16, 16), np.uint8)).save(tmp_path / "masks/extra.png")
    with pytest.raises(ImageFolderError) as e:
        match_pairs(tmp_path / "images", tmp_path / "masks")
    msg = one_line(e)
    assert "s001.png" in msg and "without a mask" in msg and "extra.png" in msg and "without an image" in msg
    with pytest.raises(ImageFolderError) as e:
        match_pairs(tmp_path / "images", tmp_path / "nope")
    assert "does not exist" in one_line(e)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ImageFolderError) as e:
        match_pairs(tmp_path / "images", tmp_path / "empty")
    assert "holds no image files" in one_line(e)


def test_checks_labels_sizes_and_halving(tmp_path):
    write_pairs(tmp_path / "a", n=3)
    ds = ImageMaskFolders(tmp_path / "a/images", tmp_path / "a/masks")
    with pytest.raises(ImageFolderError) as e:
        ds.check(classes=3, depth=2)  # shapes masks hold labels up to 3
    msg = one_line(e)
    assert "holds label 3" in msg and "classes 3" in msg and "model.classes >= 4" in msg

    write_pairs(tmp_path / "b", n=2, size=24)
    with pytest.raises(ImageFolderError) as e:
        ImageMaskFolders(tmp_path / "b/images", tmp_path / "b/masks").check(classes=4, depth=5)
    msg = one_line(e)
    assert "24x24" in msg and "multiples of 16" in msg

    save_image(tmp_path / "a/images/s002.png", torch.zeros(3, 32, 32))
    save_mask(tmp_path / "a/masks/s002.png", torch.zeros(32, 32, dtype=torch.int64))
    with pytest.raises(ImageFolderError) as e:
        ImageMaskFolders(tmp_path / "a/images", tmp_path / "a/masks").check(classes=4, depth=2)
    assert "images differ in size" in one_line(e)

    save_image(tmp_path / "a/images/s002.png", torch.zeros(3, 16, 16))
    with pytest.raises(ImageFolderError) as e:
        ImageMaskFolders(tmp_path / "a/images", tmp_path / "a/masks").check(classes=4, depth=2)
    assert "mask" in one_line(e) and "s002.png is 32x32 but its image s002.png is 16x16" in one_line(e)

    Image.fromarray(np.random.default_rng(0).integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(
        tmp_path / "a/masks/s002.png")
    with pytest.raises(ImageFolderError) as e:
        read_mask(tmp_path / "a/masks/s002.png")
    assert "colour image" in one_line(e)
    (tmp_path / "a/images/s000.png").write_bytes(b"not a png")
    with pytest.raises(ImageFolderError) as e:
        read_image(tmp_path / "a/images/s000.png")
    assert "cannot read" in one_line(e)
