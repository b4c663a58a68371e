"""LICENSE is the Apache License 2.0 that pyproject.toml declares, and CITATION.cff is a
Citation File Format 1.2.0 file that cites the project and the TRACE paper it implements."""

from __future__ import annotations

import hashlib
import re
import tomllib
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
# MD5 of the standard text as the ASF publishes it (https://www.apache.org/licenses/LICENSE-2.0.txt)
APACHE_2_MD5 = "3b83ef96387f14655fc854ddc3c6bd57"


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_license_is_the_apache_2_text_pyproject_declares():
    text = (REPO / "LICENSE").read_text()
    assert pyproject()["license"] == {"text": "Apache-2.0"}
    assert re.search(r"Apache License\s+Version 2\.0, January 2004", text)
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    for n, section in enumerate(["Definitions", "Grant of Copyright License",
                                 "Grant of Patent License", "Redistribution",
                                 "Submission of Contributions", "Trademarks",
                                 "Disclaimer of Warranty", "Limitation of Liability",
                                 "Accepting Warranty or Additional Liability"], start=1):
        assert f"{n}. {section}." in text, section
    assert "END OF TERMS AND CONDITIONS" in text
    # the whole text, word for word: no clause edited or lost
    assert hashlib.md5((REPO / "LICENSE").read_bytes()).hexdigest() == APACHE_2_MD5


def test_citation_cff_cites_the_project_and_the_paper():
    cff = yaml.safe_load((REPO / "CITATION.cff").read_text())
    assert {"cff-version", "message", "title", "authors"} <= set(cff)  # CFF's required keys
    assert cff["cff-version"] == "1.2.0"
    assert cff["message"].strip()
    project = pyproject()
    assert cff["title"] == project["name"] and str(cff["version"]) == project["version"]
    assert cff["license"] == project["license"]["text"]
    # an author is a person (family-names) or an entity (name), as CFF defines them
    assert cff["authors"] and all(a.get("name") or a.get("family-names")
                                  for a in cff["authors"])
    papers = [r for r in cff["references"]
              if r["title"] == "Tree Rollout Allocation for Contrastive Exploration"]
    assert len(papers) == 1
    paper = papers[0]
    assert paper["type"] == "article" and paper["authors"]
    assert paper["url"] == "https://arxiv.org/abs/2606.11119"
    ids = {(i["type"], i["value"]) for i in paper["identifiers"]}
    assert {("other", "arXiv:2606.11119"), ("doi", "10.48550/arXiv.2606.11119")} <= ids
