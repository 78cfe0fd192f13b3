"""Each chunker on a document of its type."""

from __future__ import annotations

from goodput_embedder.chunking import ChunkSizes, chunk_document, guess_type

SIZES = ChunkSizes(prose_tokens=50, prose_overlap=0.2, markdown_max_tokens=60, code_max_tokens=80, faq_max_tokens=40)


def test_faq_is_one_chunk_per_entry() -> None:
    text = ("Frequently asked questions\n\nQ: How do I reset my password?\nA: Use the link on the sign-in page.\n\n"
            "Q: Can I export my data?\nA: Yes, as CSV from settings.\n\nQuestion: Is there an API?\nA: Yes, REST.")
    chunks = chunk_document(text, doc_type="faq", sizes=SIZES)
    assert len(chunks) == 4  # the preamble, then three entries
    assert chunks[1].startswith("Q: How do I reset") and "sign-in page" in chunks[1]
    assert chunks[3].startswith("Question: Is there an API?")
    assert guess_type(text) == "faq"


def test_prose_windows_have_the_configured_size_and_overlap() -> None:
    words = [f"w{i}" for i in range(200)]
    chunks = chunk_document(" ".join(words), doc_type="prose", sizes=SIZES)
    sizes = [len(c.split()) for c in chunks]
    assert all(s <= 50 for s in sizes) and len(chunks) == 5
    first, second = chunks[0].split(), chunks[1].split()
    assert first[-10:] == second[:10]  # 20% overlap
    assert {w for c in chunks for w in c.split()} == set(words)  # nothing lost


def test_prose_prefers_paragraph_ends_and_short_prose_is_one_chunk() -> None:
    para1 = " ".join(f"a{i}" for i in range(45))
    para2 = " ".join(f"b{i}" for i in range(30))
    chunks = chunk_document(f"{para1}\n\n{para2}", doc_type="prose", sizes=SIZES)
    assert chunks[0].split()[-1] == "a44"  # cut at the paragraph end, not mid-paragraph at word 50
    assert chunk_document("A short note.", doc_type="prose", title="T", sizes=SIZES) == ["T\nA short note."]


def test_markdown_is_one_chunk_per_heading_with_its_path() -> None:
    text = ("# Guide\nIntro text.\n\n## Install\nRun make install.\n\n```\n# not a heading\n```\n\n"
            "## Run\nRun make run.\n### Ports\nThe gateway listens on 8080.")
    chunks = chunk_document(text, doc_type="markdown", sizes=SIZES)
    assert [c.splitlines()[0] for c in chunks] == ["Guide", "Guide > Install", "Guide > Run", "Guide > Run > Ports"]
    assert "# not a heading" in chunks[1]
    assert guess_type(text) == "markdown"


def test_code_is_one_chunk_per_function_or_class() -> None:
    text = ("import os\n\n\n@decorator\ndef alpha(x):\n    return x + 1\n\n\nclass Beta:\n    def method(self):\n"
            "        return 2\n\n\nasync def gamma():\n    await thing()\n")
    chunks = chunk_document(text, doc_type="code", sizes=SIZES)
    assert len(chunks) == 4
    assert chunks[0].strip() == "import os"
    assert chunks[1].startswith("@decorator\ndef alpha")
    assert chunks[2].startswith("class Beta") and "def method" in chunks[2]
    assert chunks[3].startswith("async def gamma")
    assert guess_type(text) == "code"
