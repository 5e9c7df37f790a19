"""Device selection, the ResNet-18 and CIFAR-shaped synthetic data (CPU; the GPU tests are in tests/gpu)."""
import numpy as np
import pytest
import torch

from ulfmtrain.core.modes import UsageError
from ulfmtrain.data.format import DatasetFile
from ulfmtrain.data.sources import synthetic_dataset
from ulfmtrain.training import device as device_mod
from ulfmtrain.training.device import device_for, local_rank, select_device, slot_local_rank
from ulfmtrain.training.models import build_model

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


def test_cpu_and_auto_without_a_gpu_train_on_the_cpu():
    assert select_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert select_device("auto") == torch.device("cpu")


@no_gpu
def test_cuda_without_a_gpu_is_one_line_naming_the_fix():
    with pytest.raises(UsageError) as exc:
        select_device("cuda")
    msg = str(exc.value)
    assert "\n" not in msg and "--device cpu" in msg and "GPU" in msg


def test_the_local_rank_prefers_the_agent_s_true_value(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "5")
    monkeypatch.delenv("ULFMTRAIN_LOCAL_RANK", raising=False)
    assert local_rank() == 5
    monkeypatch.setenv("ULFMTRAIN_LOCAL_RANK", "1")   # the agent launch: Open MPI thinks every rank is local
    assert local_rank() == 1


def test_resnet18_for_32x32_images():
    model = build_model("resnet18", classes=10, shape=(3, 32, 32))
    assert 11_100_000 < sum(p.numel() for p in model.parameters()) < 11_200_000
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_resnet18_on_flat_records_says_how_to_make_images():
    with pytest.raises(ValueError, match="--shape 3,32,32"):
        build_model("resnet18", inputs=64, shape=(64,))


def test_synthetic_images_in_cifar_shape(tmp_path):
    p = synthetic_dataset(tmp_path / "c.ulfmds", records=300, classes=10, shape=(3, 32, 32), chunk_records=128)
    flat = synthetic_dataset(tmp_path / "f.ulfmds", records=300, classes=10, features=3 * 32 * 32)
    with DatasetFile(p) as ds, DatasetFile(flat) as dflat:
        assert ds.fields[0][2] == (3, 32, 32) and ds.meta["classes"] == 10
        x, xf = ds.read(0, ds.count), dflat.read(0, dflat.count)
    assert x["x"].shape == (300, 3, 32, 32)
    np.testing.assert_array_equal(x["x"].reshape(300, -1), xf["x"])     # the same values, in image shape
    np.testing.assert_array_equal(x["y"], xf["y"])


class _Slot:
    def __init__(self, slot, placement):
        self.slot, self.placement = slot, placement


def test_the_slot_not_the_process_picks_the_gpu(monkeypatch):
    """A spare (own local rank 3) or a respawned process (own local rank 0) in slot 1 takes slot 1's GPU: the
    local rank its launch process had (mpirun's mapping may number them out of rank order)."""
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "3")
    monkeypatch.delenv("ULFMTRAIN_LOCAL_RANK", raising=False)
    placement = [0, 2, 1, 3]
    assert slot_local_rank(_Slot(1, placement)) == 2
    assert slot_local_rank(_Slot(None, placement)) == 3        # a waiting spare: its own (it holds no GPU)
    assert slot_local_rank(_Slot(1, None)) == 3                # a plain communicator: the process's own
    monkeypatch.setattr(device_mod, "cuda_missing", lambda: None)   # as if torch saw 2 GPUs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert device_for("cuda", 2) == torch.device("cuda", 0)    # several slots per GPU: L % G
    assert device_for("cuda", 3) == torch.device("cuda", 1)
    assert device_for("cpu", 3) == torch.device("cpu")


@pytest.mark.parametrize("name", ["cnn", "cnn-bn", "resnet18"])
def test_dropout_keeps_the_models_state_dict_and_initial_weights(name):
    shape = (3, 32, 32) if name == "resnet18" else (1, 8, 8)
    torch.manual_seed(0)
    plain = build_model(name, shape=shape)
    torch.manual_seed(0)
    dropped = build_model(name, shape=shape, dropout=0.5)
    assert any(isinstance(m, torch.nn.Dropout) for m in dropped.modules())
    assert not any(isinstance(m, torch.nn.Dropout) for m in plain.modules())
    a, b = plain.state_dict(), dropped.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)   # checkpoints, same seed: same start
    x = torch.randn(4, *shape)
    assert torch.equal(dropped.eval()(x), plain.eval()(x))    # evaluation: no dropout
    dropped.train()
    assert not torch.equal(dropped(x), dropped(x))       # training: it drops, two draws differ


def test_dropout_on_a_model_factory_or_out_of_range_is_one_line():
    with pytest.raises(ValueError, match="put nn.Dropout layers in your model factory"):
        build_model("ulfmtrain.training.models:large_mlp", dropout=0.1)
    from ulfmtrain.cli import build_parser
    from ulfmtrain.training.config import TrainJob

    for bad in ("1", "-0.1"):
        job = TrainJob.from_args(build_parser().parse_args(["train", "--data", "d", "--dropout", bad]))
        with pytest.raises(UsageError, match="0 <= P < 1"):
            job.validate()


def test_dropout_schedule_and_amp_survive_the_round_trip_to_argv():
    """Relaunches (supervise, reinit's replacements) rebuild the command line from the job."""
    from ulfmtrain.cli import build_parser
    from ulfmtrain.training.config import TrainJob

    argv = ["train", "--data", "d", "--dropout", "0.25", "--lr-schedule", "cosine", "--amp"]
    job = TrainJob.from_args(build_parser().parse_args(argv))
    assert (job.config.dropout, job.config.lr_schedule, job.config.amp) == (0.25, "cosine", True)
    assert TrainJob.from_args(build_parser().parse_args(job.to_argv())) == job
