"""Group sites by their top-k producer (IndexShare groups), in graph order.

Sites sharing one indexer call form a group; the owner is the site that consumes the producer first
(the first gather in graph order), the last layer is the group's last site. Singleton groups are
normal; no period or pattern is assumed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from torch import fx


class GroupedSite(Protocol):
    """What grouping reads of a front-end's site (the recipe's ``Site``, the Hugging Face form's ``HfSite``)."""

    layer: int
    producer: fx.Node  # the top-k node the site's selection comes from: the group key
    topk: fx.Node  # the top-k tensor the site reads (the recipe's gather input, the HF mask's ids)
    #: the node the site's rewrite replaces (the recipe's gather, the HF dense attention): the group's
    #: plan goes before its owner's
    anchor: fx.Node


class DetectedSites(Protocol):
    """What grouping reads of a front-end's detection report: its sites, in graph order."""

    sites: Sequence[GroupedSite]


@dataclass
class Group:
    group_id: int
    producer: fx.Node
    sites: list[Any]  # the front-end's own site type, a GroupedSite (front-ends read their fields)

    @property
    def owner(self) -> Any:
        """The group's first site (it plans and receives the metadata install)."""
        return self.sites[0]

    @property
    def last(self) -> Any:
        return self.sites[-1]

    @property
    def layers(self) -> list[int]:
        return [s.layer for s in self.sites]


@dataclass
class GroupReport:
    groups: list[Group]


def group(det: DetectedSites) -> GroupReport:
    by_producer: dict[fx.Node, list[GroupedSite]] = {}
    for s in det.sites:  # sites are in graph order already
        by_producer.setdefault(s.producer, []).append(s)
    ordered = sorted(by_producer.items(), key=lambda kv: kv[1][0].layer)
    return GroupReport([Group(i, p, sites) for i, (p, sites) in enumerate(ordered)])
