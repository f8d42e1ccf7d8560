#pragma once
// The prefix cache's index, shared by the engines (the CPU Session's snapshots, GpuEngine's snapshot slots): entries
// keyed by the token prefix they continue from, least recently used last. Prefixes end on the grid of multiples of
// Cp (the prefill chunk), where a sequence's caches equal a fresh prefill's bit for bit, so a lookup hashes the
// prompt once and probes each grid point from the longest down.
//
// Legend: Cp the grid, n tokens of a prompt, V what an entry holds (a snapshot, or where one lies).
#include <algorithm>
#include <cstdint>
#include <iterator>
#include <list>
#include <optional>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

namespace lm::infer {

// FNV-1a over token ids (the key; collisions are ruled out by comparing the tokens).
inline uint64_t hash_tokens(std::span<const int32_t> t) {
  uint64_t h = 1469598103934665603ull;
  for (int32_t x : t) {
    h ^= static_cast<uint32_t>(x);
    h *= 1099511628211ull;
  }
  return h;
}

struct PrefixStats {
  int64_t entries = 0, bytes = 0, hits = 0, misses = 0, tokens_reused = 0;
};

template <class V>
class PrefixIndex {
 public:
  struct Entry {
    std::vector<int32_t> tokens;
    V value;
    int64_t bytes = 0;
  };

  // The entry whose tokens are tokens[0 : g·Cp] for the largest grid point g·Cp ≤ max_len, made the most recent
  // (null if none; counted as a hit or a miss).
  Entry* longest(std::span<const int32_t> tokens, int64_t max_len, int64_t Cp) {
    max_len = std::min<int64_t>(max_len, static_cast<int64_t>(tokens.size()));
    std::vector<uint64_t> h;  // the hash of each grid prefix
    if (!lru_.empty() && Cp > 0) {
      uint64_t acc = hash_tokens({});
      for (int64_t i = 0; i < max_len / Cp * Cp; ++i) {
        acc = (acc ^ static_cast<uint32_t>(tokens[static_cast<size_t>(i)])) * 1099511628211ull;
        if ((i + 1) % Cp == 0) h.push_back(acc);
      }
    }
    for (int64_t g = static_cast<int64_t>(h.size()); g >= 1; --g) {
      const auto it = index_.find(h[static_cast<size_t>(g - 1)]);
      if (it == index_.end()) continue;
      const std::vector<int32_t>& t = it->second->tokens;
      if (static_cast<int64_t>(t.size()) == g * Cp && std::equal(t.begin(), t.end(), tokens.begin())) {
        lru_.splice(lru_.begin(), lru_, it->second);
        ++stats_.hits;
        stats_.tokens_reused += g * Cp;
        return &lru_.front();
      }
    }
    ++stats_.misses;
    return nullptr;
  }

  // The entry holding exactly `tokens`, made the most recent (null if none).
  Entry* find(std::span<const int32_t> tokens) {
    const auto it = index_.find(hash_tokens(tokens));
    if (it == index_.end() || !std::equal(tokens.begin(), tokens.end(), it->second->tokens.begin(),
                                          it->second->tokens.end()))
      return nullptr;
    lru_.splice(lru_.begin(), lru_, it->second);
    return &lru_.front();
  }

  // A new most recent entry. Another prefix of the same hash is displaced: its value is returned for the caller to
  // release.
  std::optional<V> insert(std::vector<int32_t> tokens, V value, int64_t bytes) {
    const uint64_t key = hash_tokens(tokens);
    std::optional<V> displaced;
    if (const auto it = index_.find(key); it != index_.end()) {
      bytes_ -= it->second->bytes;
      displaced = std::move(it->second->value);
      lru_.erase(it->second);
      index_.erase(it);
    }
    lru_.push_front(Entry{std::move(tokens), std::move(value), bytes});
    index_[key] = lru_.begin();
    bytes_ += bytes;
    return displaced;
  }

  // Removes the least recently used entry and returns its value (the index must not be empty).
  V pop_lru() {
    Entry& e = lru_.back();
    V v = std::move(e.value);
    bytes_ -= e.bytes;
    index_.erase(hash_tokens(e.tokens));
    lru_.pop_back();
    return v;
  }

  bool empty() const { return lru_.empty(); }
  int64_t bytes() const { return bytes_; }
  PrefixStats stats() const {
    PrefixStats s = stats_;
    s.entries = static_cast<int64_t>(lru_.size());
    s.bytes = bytes_;
    return s;
  }
  // Drops every entry (their values with them; the counts of hits and misses stay).
  void clear() {
    lru_.clear();
    index_.clear();
    bytes_ = 0;
  }

 private:
  std::list<Entry> lru_;  // front: the most recent
  std::unordered_map<uint64_t, typename std::list<Entry>::iterator> index_;
  int64_t bytes_ = 0;
  PrefixStats stats_;
};

}  // namespace lm::infer
