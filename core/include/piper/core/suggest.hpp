// "Did you mean ...?" for misspelt keys, flags and names: the nearest candidate by edit distance.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

namespace piper::core {

// Optimal-string-alignment distance: insertions, deletions, substitutions and adjacent swaps cost 1.
inline std::size_t edit_distance(const std::string& a, const std::string& b) {
  const std::size_t n = a.size(), m = b.size();
  std::vector<std::vector<std::size_t>> d(n + 1, std::vector<std::size_t>(m + 1));
  for (std::size_t i = 0; i <= n; ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= m; ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= n; ++i)
    for (std::size_t j = 1; j <= m; ++j) {
      const std::size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[n][m];
}

// The candidate nearest to `word`, if it is near enough to be a typo of it (at most a third of the
// word's letters wrong, and at least one allowed); else "" (also for words over 64 characters). Ties go to the first
// candidate.
inline std::string nearest(const std::string& word, const std::vector<std::string>& candidates) {
  if (word.size() > 64) return {};  // no typo of a short name; and the distance table stays small
  const std::size_t allowed = std::max<std::size_t>(1, word.size() / 3);
  std::string best;
  std::size_t best_distance = allowed + 1;
  for (const auto& c : candidates) {
    const std::size_t dist = edit_distance(word, c);
    if (dist < best_distance) best = c, best_distance = dist;
  }
  return best;
}

// " (did you mean 'x'?)" for the nearest candidate, or "" when none is near.
inline std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates) {
  const std::string n = nearest(word, candidates);
  return n.empty() ? std::string() : " (did you mean '" + n + "'?)";
}

// The hint after "unknown field": did_you_mean's, or " (expected one of: a, b, c)" when no
// candidate is near.
inline std::string unknown_field_hint(const std::string& word, const std::vector<std::string>& known) {
  std::string hint = did_you_mean(word, known);
  if (!hint.empty()) return hint;
  hint = " (expected one of: ";
  for (std::size_t i = 0; i < known.size(); ++i) hint += (i ? ", " : "") + known[i];
  return hint + ")";
}

}  // namespace piper::core
