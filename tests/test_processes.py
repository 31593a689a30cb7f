"""hf_dynbsz.testing.processes: launched commands get a port of their own, so launches can run side by side."""

from __future__ import annotations

import socket
import sys

from hf_dynbsz.testing.processes import free_port, with_free_main_process_port

LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "c.yaml", "script.py", "--x", "1"]


def test_an_accelerate_launch_gets_a_free_main_process_port():
    command = with_free_main_process_port(LAUNCH)
    at = command.index("--main_process_port")
    assert command[:at] == LAUNCH[:3] and command[at + 2 :] == LAUNCH[3:]
    port = int(command[at + 1])
    with socket.socket() as listener:  # nothing holds it: it can be bound
        listener.bind(("127.0.0.1", port))


def test_a_port_the_command_names_and_other_commands_are_left_alone():
    named = [*LAUNCH[:3], "--main_process_port", "1234", *LAUNCH[3:]]
    assert with_free_main_process_port(named) == named
    plain = [sys.executable, "tests/distributed_grpo.py"]
    assert with_free_main_process_port(plain) == plain


def test_free_ports_are_usable():
    assert 0 < free_port() < 65536
