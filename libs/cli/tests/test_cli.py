"""`goodput status` and `goodput chat` fail with one readable line, never a traceback, when nothing answers."""

from __future__ import annotations

from typer.testing import CliRunner

from goodput_testing import dead_port

from goodput_cli.main import app, usage_examples

runner = CliRunner()


def test_status_with_nothing_running_exits_non_zero_and_says_what_is_down(tmp_path):
    result = runner.invoke(app, ["status", "--state-dir", str(tmp_path), "--scheduler", f"127.0.0.1:{dead_port()}",
                                 "--gateway", f"http://127.0.0.1:{dead_port()}",
                                 "--gateway-grpc", f"127.0.0.1:{dead_port()}", "--timeout", "1"])

    assert result.exit_code == 1
    assert "Traceback" not in result.output
    assert "error: gateway is down" in result.output
    assert "scheduler is down" in result.output


def test_chat_without_gateway_exits_non_zero_with_a_hint():
    result = runner.invoke(app, ["chat", "hello", "--url", f"http://127.0.0.1:{dead_port()}", "--key", "gp-x"])

    assert result.exit_code == 1
    assert "Traceback" not in result.output
    assert "cannot reach the gateway" in result.output
    assert "goodput up" in result.output


def test_chat_without_any_key_says_where_keys_come_from(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GOODPUT_API_KEY", raising=False)

    result = runner.invoke(app, ["chat", "hello", "--url", f"http://127.0.0.1:{dead_port()}"])

    assert result.exit_code == 1
    assert "no API key" in result.output and "GOODPUT_API_KEY" in result.output


def test_chat_reads_the_dev_key_of_goodput_up(tmp_path, monkeypatch):
    from goodput_cli.keys import write_dev_keys

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GOODPUT_API_KEY", raising=False)
    write_dev_keys(tmp_path / ".goodput")

    result = runner.invoke(app, ["chat", "hello", "--url", f"http://127.0.0.1:{dead_port()}"])

    assert "cannot reach the gateway" in result.output  # got past the key lookup


def test_printed_examples_stream_with_the_key_and_model():
    text = usage_examples(base_url="http://127.0.0.1:8080", key="gp-dev-abc", model="smollm2-135m-instruct")

    assert "curl -N http://127.0.0.1:8080/v1/chat/completions" in text
    assert '-H "Authorization: Bearer gp-dev-abc"' in text
    assert '"stream": true' in text and '"model": "smollm2-135m-instruct"' in text
    assert '"temperature": 0' in text and "temperature=0," in text  # greedy: the model's most likely answer
    assert 'OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="gp-dev-abc")' in text
    snippet = text[text.index("from openai import OpenAI"):text.index("Or: goodput chat")]
    compile(snippet, "<snippet>", "exec")  # the Python snippet is valid as printed


def test_index_takes_several_paths_and_refuses_two_that_give_the_same_document_id(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "README.md").write_text("docs readme")
    (tmp_path / "README.md").write_text("top readme")
    url = f"http://127.0.0.1:{dead_port()}"

    clash = runner.invoke(app, ["index", str(tmp_path / "docs"), str(tmp_path / "README.md"), "--kb", "handbook",
                                "--url", url, "--key", "gp-x"])
    assert clash.exit_code == 1 and "both give a document with the id 'README.md'" in clash.output

    (tmp_path / "docs" / "README.md").rename(tmp_path / "docs" / "guide.md")
    both = runner.invoke(app, ["index", str(tmp_path / "docs"), str(tmp_path / "README.md"), "--kb", "handbook",
                               "--url", url, "--key", "gp-x"])
    assert both.exit_code == 1 and "Traceback" not in both.output
    assert "documents 0-1" in both.output and "cannot reach the gateway" in both.output  # both read, one batch
