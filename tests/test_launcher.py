from autotune.trials.launcher import LaunchSpec, build_command, remove_shm_buffers


def test_shm_buffers_of_one_trial_port_only_are_removed(tmp_path):
    mine = [tmp_path / f"deepspeed_allreduce_buffer_0_127.0.0.1_41234_{r}" for r in range(2)]
    other = tmp_path / "deepspeed_allreduce_buffer_0_127.0.0.1_41235_0"
    unrelated = tmp_path / "something_41234_0"
    for f in (*mine, other, unrelated):
        f.write_bytes(b"x")
    assert remove_shm_buffers(41234, shm_dir=tmp_path) == 2
    assert not any(f.exists() for f in mine)
    assert other.exists() and unrelated.exists()


def test_command_is_an_argument_list_through_deepspeeds_launcher(tmp_path):
    spec = LaunchSpec(num_ranks=4, script_args=["--steps", "3"], log_path=tmp_path / "l", timeout=1)
    cmd = build_command(spec, 29500)
    assert cmd[1:3] == ["-m", "deepspeed.launcher.runner"]
    assert cmd[cmd.index("--num_gpus") + 1] == "4" and cmd[cmd.index("--master_port") + 1] == "29500"
    assert "--no_local_rank" in cmd and cmd[-2:] == ["--steps", "3"]


def test_master_ports_come_from_below_the_ephemeral_range_and_are_free(monkeypatch):
    """The ranks' outgoing connections take ephemeral ports: a master port drawn from there was
    taken between the draw and the store's listen (EADDRINUSE beside another suite)."""
    import socket

    import autotune.trials.launcher as launcher

    low = launcher._ephemeral_low()
    ports = {launcher.free_port() for _ in range(20)}
    assert all(launcher.MASTER_PORT_FLOOR <= p < low for p in ports) and len(ports) > 1
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        draws = iter([busy, busy, 25001])
        monkeypatch.setattr(launcher.random.SystemRandom, "randint", lambda self, a, b: next(draws))
        monkeypatch.setattr(launcher, "_ephemeral_low", lambda: 65000)
        assert launcher.free_port() == 25001  # the port in use is passed over


def test_one_wait_for_every_launch_ends_on_exit_answer_or_deadline():
    """`wait_for` is the fresh launch's, the warm pool's and watch's wait (issue 41)."""
    import subprocess
    import sys
    import time

    from autotune.trials.launcher import wait_for

    def sleeper(seconds: float) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", f"import time, sys; time.sleep({seconds}); sys.exit(3)"])

    quick = sleeper(0.1)
    assert wait_for(quick, deadline=None) == (3, False)  # the launcher's own code
    slow = sleeper(30)
    try:
        t0 = time.monotonic()
        assert wait_for(slow, deadline=t0 + 0.3) == (None, True)  # no tick: the kernel's wait
        ticks: list[float] = []
        assert wait_for(slow, deadline=time.monotonic() + 0.3, tick=lambda: ticks.append(1)) == (None, True)
        assert len(ticks) >= 3  # watch's echo and evaluation ran while it waited
        assert wait_for(slow, deadline=None, answered=lambda: True) == (0, False)
        assert slow.poll() is None  # a warm pool's job answered: its ranks stay up for the next one
        assert time.monotonic() - t0 < 10
    finally:
        slow.kill()
        slow.wait()
